"""recforge as a service: a real Prefect server, `recforge serve`, real clients and a browser.

Every server here is started by the test on 127.0.0.1 (a free port, its own PREFECT_HOME
and database) and stopped at the end. Runs are triggered with `prefect deployment run`
and checked through the server's REST API, the way an operator's tools would see them.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from data_prep.synthetic import generate_logs
from flows.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
BIN = Path(sys.executable).parent
STAGES = ["ingest", "preprocess", "shard", "train", "evaluate", "export"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [pytest.mark.service, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without its Prefect settings (the test harness's API)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return {**env, **extra}


class PrefectServer:
    """`prefect server start` in its own process group, on its own home and database."""

    def __init__(self, home: Path, database_url: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        home.mkdir(parents=True, exist_ok=True)
        database_url = database_url or f"sqlite+aiosqlite:///{home / 'prefect.db'}"
        self.env = clean_env(
            PREFECT_HOME=str(home),
            PREFECT_API_DATABASE_CONNECTION_URL=database_url,
            PREFECT_UI_API_URL=self.url,
        )
        self.log = home / "server.log"
        self.process = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1"]
            + ["--port", str(self.port)],
            env=self.env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"prefect server not healthy in {timeout_s} s: {self.log}")

    def client_env(self, **extra: str) -> dict[str, str]:
        """Environment for a client of this server (CLI, `recforge serve`, a worker)."""
        return clean_env(PREFECT_API_URL=self.url, PREFECT_HOME=self.env["PREFECT_HOME"], **extra)

    def post(self, path: str, body: dict) -> list | dict:
        response = httpx.post(f"{self.url}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def get(self, path: str) -> dict:
        response = httpx.get(f"{self.url}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        stop_group(self.process)


def stop_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def trigger(server: PrefectServer, deployment: str, *params: str) -> tuple[int, str, str | None]:
    """`prefect deployment run` with `-p` params; (exit status, output, flow run id)."""
    command = [str(BIN / "prefect"), "deployment", "run", deployment]
    for param in params:
        command += ["-p", param]
    done = subprocess.run(
        command, env=server.client_env(), capture_output=True, text=True, timeout=120
    )
    output = done.stdout + done.stderr
    found = re.search(r"UUID: ([0-9a-f-]{36})", output)
    return done.returncode, output, found.group(1) if found else None


def wait_for(server: PrefectServer, flow_run_id: str, timeout_s: float = 900) -> dict:
    """Poll a flow run until it is final; returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = server.get(f"/flow_runs/{flow_run_id}")
        if run["state"] and run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} not final after {timeout_s} s")


def task_states(server: PrefectServer, flow_run_id: str) -> dict[str, str]:
    """The flow run's stage task runs: name -> state name (`Completed`, `Cached`, ...)."""
    runs = server.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {r["name"]: r["state"]["name"] for r in runs if r["name"] in [*STAGES, "plan"]}


def artifacts(server: PrefectServer, flow_run_id: str) -> dict[str, str]:
    found = server.post(
        "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    )
    return {a["key"]: str(a["data"]) for a in found if a["key"]}


def wait_for_deployments(server: PrefectServer, names: set[str], timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {
            f"{server.get('/flows/' + d['flow_id'])['name']}/{d['name']}": d
            for d in server.post("/deployments/filter", {})
        }
        if names <= found.keys():
            return found
        time.sleep(1)
    raise TimeoutError(f"deployments {names} not registered in {timeout_s} s")


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "raw"
    generate_logs(load_config(TINY, [f"generate.out={out}"]).generate)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[PrefectServer]:
    server = PrefectServer(tmp_path_factory.mktemp("prefect-sqlite"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served(server, raw_dir, tmp_path_factory) -> Iterator[dict]:
    """`recforge serve` on the tiny config, with its deployments registered."""
    root = tmp_path_factory.mktemp("artifacts")
    log = root.parent / "serve.log"
    process = subprocess.Popen(
        [str(BIN / "recforge"), "serve", TINY, "--cron", "0 3 * * *", "--root", str(root)]
        + ["--set", f"ingest.path={raw_dir}"],
        env=server.client_env(),
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        found = wait_for_deployments(server, {"recforge-pipeline/tiny", "recforge-rerun/tiny"})
        yield {"root": root, "deployments": found, "log": log, "runs": {}}
    finally:
        stop_group(process)


@pytest.fixture(scope="module")
def first_run(server, served) -> dict:
    """A full run, triggered by a real client with a parameter."""
    rc, output, flow_run_id = trigger(server, "recforge-pipeline/tiny", 'force=["train"]')
    assert rc == 0 and flow_run_id, output
    run = wait_for(server, flow_run_id)
    assert run["state"]["type"] == "COMPLETED", (run["state"], served["log"].read_text()[-4000:])
    served["runs"]["first"] = flow_run_id
    return run


def test_serve_registers_typed_scheduled_deployments(served):
    pipeline = served["deployments"]["recforge-pipeline/tiny"]
    rerun = served["deployments"]["recforge-rerun/tiny"]
    assert pipeline["enforce_parameter_schema"] and rerun["enforce_parameter_schema"]
    assert [s["schedule"]["cron"] for s in pipeline["schedules"]] == ["0 3 * * *"]
    schema = pipeline["parameter_openapi_schema"]["properties"]
    assert {"config", "root", "from_stage", "only", "force", "overrides"} <= schema.keys()
    assert "evaluate" in json.dumps(schema["from_stage"])
    assert "stage" in rerun["parameter_openapi_schema"]["required"]


def test_a_triggered_run_completes_all_six_stages(server, served, first_run):
    states = task_states(server, first_run["id"])
    assert states == {"plan": "Completed", **dict.fromkeys(STAGES, "Completed")}, states
    assert first_run["name"] == "tiny"
    record_path = next(Path(served["root"], "runs").glob("*/summary.json"))
    record = json.loads(record_path.read_text())
    assert [record["stages"][s]["status"] for s in STAGES] == ["ran"] * 6
    shown = artifacts(server, first_run["id"])
    assert {"plan", "run-record", "evaluate-metrics", "model-card"} <= shown.keys()
    assert record["model"] in shown["run-record"]


def test_from_stage_evaluate_runs_only_evaluate_and_export(server, served, first_run):
    rc, output, flow_run_id = trigger(server, "recforge-pipeline/tiny", "from_stage=evaluate")
    assert rc == 0, output
    run = wait_for(server, flow_run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"] == "tiny from evaluate"
    expected = {"plan": "Completed", **dict.fromkeys(STAGES[:4], "Cached")}
    expected |= {"evaluate": "Completed", "export": "Completed"}
    assert task_states(server, flow_run_id) == expected
    plan = artifacts(server, flow_run_id)["plan"]
    assert "| train | **cached** |" in plan and "| evaluate | **run** |" in plan

    # The rerun deployment: one stage, from the UI's form or a client.
    rc, output, flow_run_id = trigger(
        server, "recforge-rerun/tiny", "stage=export", "downstream=false"
    )
    assert rc == 0, output
    run = wait_for(server, flow_run_id)
    assert run["state"]["type"] == "COMPLETED" and run["name"] == "tiny: rerun export"
    states = task_states(server, flow_run_id)
    assert states["export"] == "Completed"
    assert {states[s] for s in STAGES[:5]} == {"Cached"}


def test_bad_parameters_are_rejected_before_any_stage_runs(server, served):
    def triggered() -> int:  # flow runs not created by the cron schedule
        return sum(not r["auto_scheduled"] for r in server.post("/flow_runs/filter", {}))

    before = triggered()
    rc, output, _ = trigger(server, "recforge-pipeline/tiny", "from_stage=evaluat")
    assert rc != 0
    assert "'evaluat' is not one of" in " ".join(output.split()), output
    rc, output, _ = trigger(server, "recforge-rerun/tiny", "stage=bogus")
    assert rc != 0 and "'bogus' is not one of" in " ".join(output.split()), output
    assert triggered() == before  # nothing was created

    missing = REPO / "configs" / "nope.yaml"
    rc, output, flow_run_id = trigger(server, "recforge-pipeline/tiny", f"config={missing}")
    assert rc == 0, output  # the type is right; the flow refuses it at once
    run = wait_for(server, flow_run_id)
    assert run["state"]["type"] == "FAILED"
    assert str(missing) in run["state"]["message"]
    assert task_states(server, flow_run_id) == {}  # not even the plan ran
    failure = artifacts(server, flow_run_id)["failure"]
    assert "before any stage ran" in failure and str(missing) in failure

    # A config outside configs/ or a root the deployment was not created with: refused
    # at flow start, naming the setting that would allow it.
    elsewhere = served["root"].parent / "elsewhere"
    for param, allowed_by in (
        (f"config={served['root'] / 'mine.yaml'}", "RECFORGE_CONFIG_DIR"),
        (f"root={elsewhere}", "RECFORGE_ALLOWED_ROOTS"),
    ):
        rc, output, flow_run_id = trigger(server, "recforge-pipeline/tiny", param)
        assert rc == 0, output
        run = wait_for(server, flow_run_id)
        assert run["state"]["type"] == "FAILED" and allowed_by in run["state"]["message"]
        assert task_states(server, flow_run_id) == {}
    assert not elsewhere.exists()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_browser_shows_the_six_stages_on_the_flow_run_page(server, served, first_run, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    url = server.url.removesuffix("/api") + f"/runs/flow-run/{first_run['id']}"
    flags = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=flags)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(url)
            page.get_by_text("recforge-pipeline").first.wait_for(timeout=60_000)
            page.get_by_text("Task Runs", exact=True).first.click()
            for stage in STAGES:
                page.get_by_text(stage, exact=True).first.wait_for(state="visible", timeout=60_000)
            page.wait_for_timeout(1500)  # the run graph draws after the list
            shot = tmp_path / "flow-run.png"
            page.screenshot(path=str(shot), full_page=True)
            text = page.inner_text("body")
        finally:
            browser.close()
    assert "Completed" in text and "tiny" in text
    assert shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")


def test_deploy_applies_a_prefect_yaml_that_a_work_pool_worker_runs(server, served, tmp_path):
    env = server.client_env()
    pool = "recforge-test-pool"
    subprocess.run(
        [str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process"],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    out = tmp_path / "prefect.yaml"
    overrides = served["deployments"]["recforge-pipeline/tiny"]["parameters"]["overrides"]
    command = [str(BIN / "recforge"), "deploy", TINY, "--pool", pool, "--name", "tiny-pool"]
    command += ["--root", str(served["root"]), "--out", str(out), "--apply"]
    command += [f"--set={o}" for o in overrides]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = wait_for_deployments(
        server, {"recforge-pipeline/tiny-pool", "recforge-rerun/tiny-pool"}
    )
    assert found["recforge-pipeline/tiny-pool"]["work_pool_name"] == pool

    rc, output, flow_run_id = trigger(server, "recforge-rerun/tiny-pool", "stage=export")
    assert rc == 0, output
    worker = subprocess.run(
        [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--run-once"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    run = wait_for(server, flow_run_id, timeout_s=60)
    assert run["state"]["type"] == "COMPLETED", worker.stdout[-3000:] + worker.stderr[-3000:]
    assert task_states(server, flow_run_id)["export"] == "Completed"


def _postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@pytest.mark.skipif(_postgres_bin() is None, reason="needs PostgreSQL (apt-get install postgresql)")
def test_prefect_server_on_postgresql_records_a_pipeline_run(raw_dir, tmp_path):
    pytest.importorskip("asyncpg")
    bin_dir = _postgres_bin()
    # initdb and postgres refuse to run as root; CI runs as root, so use the package's
    # user, in a directory it can reach (pytest's tmp_path is private to root).
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    pg_dir = Path(tempfile.mkdtemp(prefix="recforge-pg-"))
    data, port = pg_dir / "data", free_port()
    data.mkdir()
    if as_user:
        shutil.chown(pg_dir, "postgres")
        shutil.chown(data, "postgres")
    run = lambda *args: subprocess.run(  # noqa: E731
        [*as_user, *args], check=True, capture_output=True, text=True, timeout=120
    )
    run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres")
    run(
        str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(data / "log"), "-w", "-o",
        f"-p {port} -k {pg_dir} -c listen_addresses=127.0.0.1", "start",
    )  # fmt: skip
    server = None
    try:
        connect = ["-h", "127.0.0.1", "-p", str(port), "-U", "postgres"]
        run(str(bin_dir / "createdb"), *connect, "prefect")
        url = f"postgresql+asyncpg://postgres@127.0.0.1:{port}/prefect"
        server = PrefectServer(tmp_path / "prefect-pg", database_url=url)
        done = subprocess.run(
            [str(BIN / "recforge"), "run", TINY, "--root", str(tmp_path / "art")]
            + ["--only", "ingest", "--set", f"ingest.path={raw_dir}"],
            env=server.client_env(), cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs = server.post("/flow_runs/filter", {})
        assert [r["state"]["type"] for r in runs] == ["COMPLETED"]
        states = task_states(server, runs[0]["id"])
        assert states == {"plan": "Completed", "ingest": "Completed"} | dict.fromkeys(
            STAGES[1:], "Skipped"
        )
        # The run is in PostgreSQL's tables, not in a SQLite file.
        query = "select count(*) from flow_run"
        rows = run(str(bin_dir / "psql"), *connect, "-d", "prefect", "-tAc", query).stdout
        assert int(rows.strip()) == 1
        assert not list((tmp_path / "prefect-pg").glob("*.db"))
    finally:
        if server is not None:
            server.stop()
        subprocess.run(
            [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"],
            capture_output=True, timeout=60,
        )  # fmt: skip
        shutil.rmtree(pg_dir, ignore_errors=True)
