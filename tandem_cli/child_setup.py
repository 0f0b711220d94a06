"""What a process ``tandem up`` starts does to itself first (``python -m tandem_cli`` calls it before torch
starts its threads): pin the cores the launcher gave it and die with the launcher.

The launcher passes them in the environment rather than doing them in a ``preexec_fn``: code between fork
and exec in a process with threads (the launcher's supervisor) can deadlock on a lock another thread held
at the fork (seen: a restart stuck in ``_fork_exec``).
"""

from __future__ import annotations

import os
import signal

PIN_CPUS_ENV = "TANDEM_PIN_CPUS"
PARENT_PID_ENV = "TANDEM_LAUNCHER_PID"


def adopt_launcher_settings(environ: dict[str, str] | None = None) -> None:
    """In a process ``tandem up`` started, first thing: pin the cores it was given and die with the launcher
    (PR_SET_PDEATHSIG, so no orphans if the launcher is killed); exit at once if it is already gone."""
    if environ is None:  # taken out of this process's environment: its own children are not the launcher's
        environ = {k: os.environ.pop(k) for k in (PIN_CPUS_ENV, PARENT_PID_ENV) if k in os.environ}
    cpus = environ.get(PIN_CPUS_ENV, "")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    parent = environ.get(PARENT_PID_ENV, "")
    if not parent:
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:  # not Linux/glibc: the launcher's own stop() still ends the children
        return
    if os.getppid() != int(parent):  # the launcher died before the death signal was armed
        raise SystemExit(f"tandem: the launcher (pid {parent}) has exited; not starting")
