import time
from pathlib import Path

import pytest

from artifacts.errors import ConfigError
from flows.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def test_run_flags_parse():
    args = build_parser().parse_args(
        [
            "run",
            "configs/tiny.yaml",
            "--only",
            "train,evaluate",
            "--force",
            "shard",
            "--set",
            "train.lr=0.1",
            "--set",
            "train.epochs=2",
        ]
    )
    assert args.only == ["train", "evaluate"] and args.force == ["shard"]
    assert args.overrides == ["train.lr=0.1", "train.epochs=2"]


def test_unknown_stage_is_rejected(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "configs/tiny.yaml", "--only", "trian"])
    assert "unknown stage" in capsys.readouterr().err


def test_from_and_only_are_exclusive():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "c.yaml", "--from", "train", "--only", "train"])


def test_bad_config_fails_fast_with_one_message(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbogus: 1\n")
    assert main(["run", str(bad), "--root", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "unknown key" in err
    assert not (tmp_path / "art").exists()


def test_unknown_override_fails_fast(capsys):
    assert main(["run", "configs/tiny.yaml", "--set", "train.lrr=1"]) == 2
    assert "train.lrr" in capsys.readouterr().err


def test_serve_builds_the_pipeline_and_rerun_deployments_with_typed_parameters():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import deployments, pipeline, rerun

    main_run, rerun_run = deployments(
        "configs/tiny.yaml", "artifacts", "tiny", "0 3 * * *", overrides=["train.lr=0.01"]
    )
    assert (main_run.name, rerun_run.name) == ("tiny", "tiny")
    assert main_run.flow_name == "recforge-pipeline" and rerun_run.flow_name == "recforge-rerun"
    assert main_run.schedules[0].schedule.cron == "0 3 * * *"
    assert not rerun_run.schedules  # triggered with a stage, unless --rerun-cron
    assert main_run.parameters["config"] == str(Path("configs/tiny.yaml").absolute())
    assert main_run.parameters["overrides"] == ["train.lr=0.01"]
    # Flat, typed parameters: stage names are an enum, so the server rejects typos.
    assert main_run.enforce_parameter_schema and rerun_run.enforce_parameter_schema
    schema = parameter_schema(pipeline.fn).model_dump()
    assert {"config", "root", "from_stage", "only", "force", "overrides"} <= set(
        schema["properties"]
    )
    assert schema["required"] == ["config"]
    assert "evaluate" in str(schema["properties"]["from_stage"])
    rerun_schema = parameter_schema(rerun.fn).model_dump()
    assert set(rerun_schema["required"]) == {"config", "stage"}
    assert "Rerun just" not in str(rerun_schema) and "stage to rerun" in str(rerun_schema)

    scheduled = deployments("configs/tiny.yaml", "a", "tiny", None, "0 4 * * *", "evaluate")[1]
    assert scheduled.parameters["stage"] == "evaluate"
    with pytest.raises(ConfigError, match="--rerun-stage"):
        deployments("configs/tiny.yaml", "a", "tiny", None, "0 4 * * *")


def test_deploy_writes_a_prefect_yaml_for_a_work_pool(tmp_path, capsys):
    import yaml

    out = tmp_path / "prefect.yaml"
    argv = ["deploy", "configs/tiny.yaml", "--pool", "cpu", "--cron", "0 3 * * *", "--out"]
    assert main([*argv, str(out), "--set", "train.lr=0.01"]) == 0
    assert "prefect --no-prompt deploy --all" in capsys.readouterr().out
    document = yaml.safe_load(out.read_text())
    by_entry = {d["entrypoint"]: d for d in document["deployments"]}
    pipeline, rerun = by_entry["flows/pipeline.py:pipeline"], by_entry["flows/pipeline.py:rerun"]
    assert pipeline["name"] == rerun["name"] == "tiny"
    assert pipeline["work_pool"]["name"] == "cpu" and pipeline["enforce_parameter_schema"]
    assert pipeline["schedules"] == [{"cron": "0 3 * * *", "timezone": "UTC"}]
    assert rerun["schedules"] == []
    assert pipeline["parameters"]["overrides"] == ["train.lr=0.01"]
    workdir = document["pull"][0]["prefect.deployments.steps.set_working_directory"]
    assert (Path(workdir["directory"]) / "flows" / "pipeline.py").is_file()
    # A bad config is refused before anything is written.
    assert (
        main(
            [
                "deploy",
                "configs/tiny.yaml",
                "--pool",
                "cpu",
                "--out",
                str(tmp_path / "b.yaml"),
                "--set",
                "train.bogus=1",
            ]
        )
        == 2
    )
    assert not (tmp_path / "b.yaml").exists()


def test_task_runner_flags():
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from flows.cli import task_runner

    threads = task_runner(3, None)
    assert isinstance(threads, ThreadPoolTaskRunner) and threads._max_workers == 3
    local = task_runner(None, "local:2")
    assert isinstance(local, DaskTaskRunner) and local.cluster_kwargs["n_workers"] == 2
    remote = task_runner(None, "tcp://10.0.0.1:8786")
    assert remote.address == "tcp://10.0.0.1:8786"


def test_cli_stage_names_match_the_pipeline():
    """The CLI takes the stage names from the one place they are spelled."""
    from artifacts.store import STAGES

    for stage in STAGES:
        assert build_parser().parse_args(["run", "c.yaml", "--from", stage]).from_stage == stage
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "c.yaml", "--from", "exports"])


def test_the_hostfile_flag_sets_the_train_hostfile(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    # With the default launcher (local) a hostfile is refused at parse time, naming it.
    assert main(["run", "configs/tiny.yaml", "--hostfile", str(hostfile)]) == 2
    assert f"train.hostfile='{hostfile}' applies to launcher 'ssh' or 'per_node'" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("root", "meant"),
    [("s3:/bucket/x", "s3://bucket/x"), ("s4://bucket/x", "s3://bucket/x"),
     ("s3//bucket/x", "s3://bucket/x")],
)  # fmt: skip
def test_a_mistyped_root_fails_at_once_with_did_you_mean_and_creates_nothing(
    root, meant, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    assert main(["run", str(REPO / "configs" / "demo.yaml"), "--root", root]) == 2
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"did you mean {meant}?" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_an_object_store_that_does_not_answer_fails_before_prefect_starts(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    started = time.monotonic()
    code = main(["run", str(REPO / "configs" / "demo.yaml"), "--root", "s3://bucket/x"])
    assert code == 2 and time.monotonic() - started < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the artifact store s3://bucket/x" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_node_worker_whose_prefect_api_does_not_answer_fails_at_start(capsys, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = "http://127.0.0.1:1/api"  # nothing listens there
    monkeypatch.setenv("PREFECT_API_URL", url)
    started = time.monotonic()
    with temporary_settings(updates={PREFECT_API_URL: url}):
        code = main(["node-worker", "--node-rank", "1", "--root", "s3://bucket/x"])
    assert code == 2 and time.monotonic() - started < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the Prefect API at {url} did not answer" in err[0], err
