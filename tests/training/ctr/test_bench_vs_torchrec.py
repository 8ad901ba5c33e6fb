"""bench/vs_torchrec.py's --quick mode, run so that the peer bench cannot rot.

recforge's side always runs (the 2-rank wide cell: the exchange and 100 slots, in
~20 s); TorchRec's side only where the `peers` extra is installed (`make peers`), which a
fresh clone's `make test` does not do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "vs_torchrec.py"
PHASES = {"data", "lookup", "dense", "optimizer", "total"}


def run_quick(workdir: Path, *flags: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-warmup", "--workdir", str(workdir), *flags],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_quick_recforge_side_reports_every_figure(tmp_path: Path) -> None:
    cells = ["1000slots_2ranks"]
    figures = run_quick(tmp_path, "--recforge-only", "--cells", ",".join(cells))
    for cell in cells:
        # No peer ran: the ratios are null, never a made-up number.
        assert figures[f"vs_torchrec_{cell}"] is None
        assert figures[f"rss_ratio_vs_torchrec_{cell}"] is None
        recforge = figures["cells"][cell]["recforge"]
        assert recforge["samples_per_s"] > 0
        assert set(recforge["step_ms"]) == PHASES
        assert recforge["step_ms"]["total"] > 0
        assert len(recforge["peak_rss_mb"]) == 2 and min(recforge["peak_rss_mb"]) > 0
        # 2 ranks share the machine's cores equally (1 each on the 2-core build machine).
        assert recforge["threads_per_rank"] == max(1, (os.cpu_count() or 1) // 2)
        startup = recforge["rank0_startup_s"]
        assert {"imports", "rendezvous", "table_init", "engine", "reader"} <= set(startup)
        assert 0 < recforge["time_to_first_step_s"] < recforge["launch_to_exit_s"]
    assert figures["cells"]["1000slots_2ranks"]["rows"] == 100 * 2000


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("torchrec") is None or importlib.util.find_spec("fbgemm_gpu") is None,
    reason="the peers extra (make peers) is not installed",
)
def test_quick_against_torchrec_gives_ratios(tmp_path: Path) -> None:
    figures = run_quick(tmp_path, "--cells", "1m_1proc")
    assert figures["vs_torchrec_1m_1proc"] > 0
    assert figures["rss_ratio_vs_torchrec_1m_1proc"] > 0
    torchrec = figures["cells"]["1m_1proc"]["torchrec"]
    assert torchrec["samples_per_s"] > 0 and torchrec["tables_per_rank"] == [8]
