"""The folder the processes of one multi-API-server `gateway serve` share (the supervisor,
which makes and removes it, and each API-server process).

    <folder>/input-<i>-<e>, output-<i>-<e>, heartbeat-<i>-<e>   ZMQ (ipc) addresses between
                                     API server i and engine core e (0 unless data parallel)
    <folder>/metrics/                PROMETHEUS_MULTIPROC_DIR, unless the operator set one
    <folder>/plugins/<pid>.json      each process's plugin load report, role and pid

Each process rewrites its own report when it changes; a reader takes every other file as
it is (`GET /v1/plugins` on any API server shows every process). Writes are atomic.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gateway.plugins.process import load_report, process_role


class ServerDir:
    """One shared folder. A report file is replaced atomically (write, then rename), so a reader
    never sees half of one.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls) -> ServerDir:
        folder = cls(tempfile.mkdtemp(prefix="gateway-api-servers-"))
        (folder.path / "plugins").mkdir()
        (folder.path / "metrics").mkdir()
        return folder

    def input_address(self, index: int, engine: int = 0) -> str:
        return f"ipc://{self.path}/input-{index}-{engine}"

    def output_address(self, index: int, engine: int = 0) -> str:
        return f"ipc://{self.path}/output-{index}-{engine}"

    def heartbeat_address(self, index: int, engine: int = 0) -> str:
        """Where engine core `engine` sends API server `index` its heartbeat."""
        return f"ipc://{self.path}/heartbeat-{index}-{engine}"

    @property
    def metrics_dir(self) -> str:
        return str(self.path / "metrics")

    def publish_report(self) -> None:
        """Write this process's load report (role and pid in every record)."""
        text = json.dumps({"role": process_role(), "pid": os.getpid(),
                           "records": _stamped(load_report().to_dicts())})
        target = self.path / "plugins" / f"{os.getpid()}.json"
        scratch = target.with_suffix(".tmp")
        scratch.write_text(text)
        scratch.replace(target)

    def peer_reports(self) -> list[dict[str, Any]]:
        """Every other process's published report: [{"role", "pid", "records"}], by role."""
        reports = []
        for path in sorted((self.path / "plugins").glob("*.json")):
            if path.stem == str(os.getpid()):
                continue
            try:
                reports.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # its process is rewriting it or has just removed it
        return sorted(reports, key=lambda report: str(report.get("role")))

    def peer_records(self) -> list[dict[str, Any]]:
        return [record for report in self.peer_reports() for record in report["records"]]

    def peer_pids(self) -> dict[str, int]:
        """role -> pid of every other process that published a report."""
        return {str(report["role"]): int(report["pid"]) for report in self.peer_reports()}


def _stamped(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records made before this process took its final role (the supervisor starts as
    `api-server`) carry that role; every record here is this process's."""
    role = process_role()
    return [dict(record, process_role=role, pid=os.getpid()) for record in records]
