"""Dependencies point one way: gateway -> common; services -> kv_transfer -> common (parsed with ast)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "prefill_service", "decode_service", "kv_transfer", "tandem_cli")


def _imports(package: str) -> dict[Path, set[str]]:
    found: dict[Path, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[path] = names
    return found


def _violations(package: str, forbidden: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {sorted(names & forbidden)}"
            for path, names in _imports(package).items() if names & forbidden]


def test_gateway_imports_no_torch() -> None:
    forbidden = {"torch", "triton", "flash_attn", "transformers", "prefill_service", "decode_service",
                 "kv_transfer"}
    assert _violations("gateway", forbidden) == []


def test_common_imports_no_service() -> None:
    assert _violations("common", set(SERVICES)) == []


def test_kv_transfer_imports_no_service() -> None:
    assert _violations("kv_transfer", {"gateway", "prefill_service", "decode_service", "tandem_cli"}) == []


def test_services_do_not_import_each_other() -> None:
    assert _violations("prefill_service", {"decode_service", "gateway", "tandem_cli"}) == []
    assert _violations("decode_service", {"prefill_service", "gateway", "tandem_cli"}) == []


def test_pure_python_scheduling_modules_import_no_torch() -> None:
    pure = ["common/kv/block_pool.py", "common/kv/kv_cache_manager.py", "common/kv/block_hash.py",
            "common/tokenizer.py", "common/config/settings.py", "common/config/model_config.py"]
    bad = []
    for rel in pure:
        path = ROOT / rel
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m.split(".")[0] == "torch" for m in mods):
                bad.append(rel)
    assert bad == []
