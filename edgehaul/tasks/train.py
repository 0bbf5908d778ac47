"""Task wrappers of training: dataset resolution, quota check, the training run, its report, publish.

Retries only on I/O trouble (object store, network, a killed torchrun child); a retried training
task resumes from the run's last committed checkpoint, so a retry costs at most one interval.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from edgehaul.blocks import ObjectStore, TeamQuota
from edgehaul.lineage import list_lineages
from edgehaul.platform.reporting import Progress, summary_table
from edgehaul.platform.s3_errors import IO_RETRY
from edgehaul.training import registry
from edgehaul.training.catch_up import TrainingPlan, plan_version
from edgehaul.training.data import latest_version
from edgehaul.training.launch import run
from edgehaul.training.quota import check_quota, usage_from_lineage
from edgehaul.training.report import markdown_with_image, metrics_table, plot_png
from edgehaul.training.trainer import TrainConfig


@task(**IO_RETRY, cache_policy=NO_CACHE)
def plan_training(store: ObjectStore, kind: str, requested: int | None, model_name: str, catch_up: bool,
                  run_id: str) -> tuple[str, TrainingPlan]:
    """(dataset URI, which version to train): the newest, once; see `edgehaul.training.catch_up`.
    The run's own registered model does not count as covering it: a retried run returns its result."""
    uri = store.uri("curated", kind)
    latest = latest_version(uri, store.storage_options())
    trained = registry.trained_versions(store, model_name, uri) if catch_up else {}
    trained = {v: m for v, m in trained.items() if m != run_id}
    return uri, plan_version(requested, latest, trained, catch_up=catch_up)


@task(**IO_RETRY, cache_policy=NO_CACHE)
def check_team_quota(store: ObjectStore, quota: TeamQuota, accelerators: int, hours: float,
                     storage_bytes: int) -> dict[str, Any]:
    usage = usage_from_lineage((lin.doc for lin in list_lineages(store)), quota.team)
    check_quota(quota, usage, accelerators, hours, storage_bytes)
    return asdict(usage)


@task(**IO_RETRY, cache_policy=NO_CACHE)
def train_run(cfg: TrainConfig, store: ObjectStore, nproc_per_node: int) -> dict[str, Any]:
    """The training, with a progress artifact `train-<model>-progress` (epochs done, loss, last checkpoint)."""
    with Progress(f"train-{cfg.model_name}-progress", total=100,
                  description=f"run {cfg.run_id}: {cfg.epochs} epochs on {cfg.dataset_uri} v{cfg.dataset_version}") as bar:
        return asdict(run(cfg, store, nproc_per_node, lambda pct, what: bar.show(pct, f"run {cfg.run_id}: {what}")))


@task(**IO_RETRY, cache_policy=NO_CACHE)
def report_training(store: ObjectStore, result: dict[str, Any], model_name: str) -> dict[str, str]:
    """Table + plot artifacts. The plot goes next to the model; the image artifact links it with a
    presigned URL (7 days), and a markdown artifact carries it inline for UIs that cannot reach the store."""
    history, model_id = result["history"], result["model_id"]
    key = f"train-{model_name}"
    summary_table(f"{key}-metrics", metrics_table(history),
                  f"Per-epoch metrics of model {model_id} ({result['steps']} steps, {result['world_size']} processes)")
    png = plot_png(history, f"{model_name} {model_id}")
    s3 = store.client()
    bucket, pkey = store.bucket("models"), store.key("models", f"{model_name}/{model_id}/metrics.png")
    s3.put_object(Bucket=bucket, Key=pkey, Body=png, ContentType="image/png")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": pkey}, ExpiresIn=7 * 86400)
    create_image_artifact(image_url=url, key=f"{key}-plot", description=f"Loss and accuracy of {model_id}")
    create_markdown_artifact(markdown=markdown_with_image(png, f"{model_name} {model_id}"), key=f"{key}-plot-inline")
    return {"plot_uri": f"s3://{bucket}/{pkey}", "plot_url": url}


@task(**IO_RETRY, cache_policy=NO_CACHE)
def publish(store: ObjectStore, model_name: str, model_id: str, allow_older: bool = False,
            gate: bool = True) -> dict[str, Any]:
    """The new latest.json pointer; a model trained on an older version of the published model's dataset
    (trainings can finish out of order) is not an error: the newer model stays published and the result
    says why (`published: False`, `reason`). With `gate`, a model below the publish gate
    (`registry.check_quality`) is not published either, the result saying why."""
    try:
        if gate:
            lineage = registry.read_lineage(store, model_name, model_id)
            if lineage is None:
                raise registry.RegistryError(f"model {model_name}/{model_id} is not registered")
            registry.check_quality(lineage)
    except registry.QualityGateFailed as e:
        get_run_logger().warning("not published: %s", e)
        return {"model_id": model_id, "published": False, "reason": str(e)}
    try:
        return registry.publish(store, model_name, model_id, allow_older=allow_older)
    except registry.StaleModel as e:
        get_run_logger().warning("not published: %s", e)
        return {"model_id": model_id, "published": False, "reason": str(e)}
