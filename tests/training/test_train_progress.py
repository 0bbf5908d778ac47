"""What an operator sees of a training run in the UI: a name that says what it trains, a progress artifact
that follows epochs and checkpoints, and the trainer's epoch and checkpoint lines in the run's logs."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore
from edgehaul.platform.reporting import Progress
from edgehaul_dev import localstack
from tests.train_support import make_dataset, train_small
from tests.waiting import run_log_lines


@given(steps=st.lists(st.floats(0, 100, allow_nan=False), max_size=20))
def test_progress_show_sets_the_percent_and_never_passes_100(steps: list[float]) -> None:
    with Progress("x", total=100) as p:
        for pct in steps:
            p.show(pct, f"at {pct}")
            assert p.percent == pytest.approx(round(pct), abs=1e-9)
            assert p.description == f"at {pct}"
    assert p.percent == 100.0


@pytest.mark.integration
def test_train_model_run_name_progress_artifact_and_domain_log_lines(stack: localstack.StackState,
                                                                    store: ObjectStore) -> None:
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client

    tag = uuid.uuid4().hex[:8]
    model = f"m-{tag}"
    state, out = train_small(store, tag, epochs=2)
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(run_id).name
    assert name == f"train_model: {model} on landsat_patch@latest ({str(run_id)[:6]})"

    progress = Artifact.get(f"train-{model}-progress")
    assert progress is not None and progress.type == "progress" and progress.data == 100.0
    assert progress.description == (f"run {out['run_id']}: epoch 2/2: loss {out['history'][-1]['train_loss']:.4f}, "
                                    f"val_loss {out['history'][-1]['val_loss']:.4f}, "
                                    f"val_acc {out['history'][-1]['val_acc']:.3f}, "
                                    f"macro-F1 {out['history'][-1]['val_macro_f1']:.3f} (step {out['history'][-1]['step']})")

    lines = run_log_lines(run_id, f"run {out['run_id']} epoch 1: loss")
    assert any(line.startswith("edgehaul.training.trainer: checkpoint committed run=") for line in lines), lines
    assert sum("edgehaul.training.trainer: run " in line and " epoch " in line for line in lines) == 2, lines


@pytest.mark.integration
def test_trainer_reports_epochs_and_checkpoints_and_a_failing_display_does_not_stop_it(store: ObjectStore) -> None:
    from edgehaul.training.trainer import TrainConfig, train

    uri = make_dataset(store, [120])
    seen: list[tuple[float, str]] = []

    def display(pct: float, what: str) -> None:
        seen.append((pct, what))
        raise RuntimeError("artifact API down")

    cfg = TrainConfig(run_id=f"p-{uuid.uuid4().hex[:8]}", dataset_uri=uri, dataset_version=0, epochs=2, batch_size=16,
                      quality_gate=False,
                      width=8, num_threads=1, checkpoint_every_steps=4, emit_events=False)
    res = train(cfg, store, display)
    assert len(res.history) == 2 and res.steps > 0
    epochs = [(p, w) for p, w in seen if ": loss " in w]
    assert [p for p, _ in epochs] == [50.0, 100.0]
    assert [w.split(":")[0] for _, w in epochs] == ["epoch 1/2", "epoch 2/2"]
    commits = [w for _, w in seen if "checkpoint committed at step" in w]
    assert len(commits) == res.steps // 4, seen  # one per committed checkpoint
    assert [p for p, _ in seen] == sorted(p for p, _ in seen)  # never goes back
