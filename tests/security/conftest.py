"""Fixtures for the security tests: a throwaway CA with certificates, and a second CA nobody trusts."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.model import ServedModel
from tests.security.certs import CertificateAuthority, Pki


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    authority = CertificateAuthority(directory)
    rogue = CertificateAuthority(directory / "rogue", "rogue")
    return Pki(authority.ca, authority.issue("node"), authority.issue("member"), rogue.issue("intruder"))


@pytest.fixture(scope="session")
def served_model(smollm2_dir: Path) -> ServedModel:
    return ServedModel.load(smollm2_dir)
