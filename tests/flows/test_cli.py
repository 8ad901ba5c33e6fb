import pytest

from flows.cli import build_parser, main


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


def test_serve_builds_a_scheduled_deployment_with_typed_parameters():
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline, pipeline_deployment

    deployment = pipeline_deployment("configs/tiny.yaml", "0 3 * * *", "artifacts", "tiny")
    assert deployment.name == "tiny"
    assert deployment.schedules[0].schedule.cron == "0 3 * * *"
    assert deployment.parameters["params"]["config"] == "configs/tiny.yaml"
    # The UI form comes from RunParams: stage names are an enum, so typos are rejected.
    assert deployment.enforce_parameter_schema
    schema = parameter_schema(pipeline.fn).model_dump()
    run_params = schema["definitions"]["RunParams"]["properties"]
    assert {"config", "root", "from_stage", "only", "force", "overrides"} <= set(run_params)
    assert "evaluate" in str(run_params["from_stage"])


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
    from flows.cli import STAGE_NAMES
    from tasks.common import STAGES

    assert STAGE_NAMES == STAGES
