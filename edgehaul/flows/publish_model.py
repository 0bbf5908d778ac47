"""publish_model: make a registered model the one edge nodes score with.

Reads the model's lineage.json, applies the quality gate (on by default: the registered epoch's validation
macro-F1 must reach a uniform-prior guesser's plus `min_macro_f1_over_chance`, 0.05; optionally a
val_acc floor; `registry.check_quality`), then swaps
`models/<name>/latest.json` with a conditional write (create-if-absent or If-Match on the old
ETag), so two publishers never overwrite each other silently. Edges load it through
`edgehaul.edge.model_scorer.ModelScorer("latest")`. A model trained on an older version of the published
model's dataset is not published (trainings can finish out of version order) unless `allow_older`. Triggered by MODEL_READY
(`{{ event.payload.model_id }}`) or run by hand.

Blocks: ObjectStore `store_block`. Cache policy: none (publishing is idempotent per model id).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from pydantic import BaseModel, Field

from edgehaul.blocks import ObjectStore
from edgehaul.ops import store_probe
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.fields import Name, RunId
from edgehaul.platform.reporting import run_namer
from edgehaul.platform.roles import StoreBlock
from edgehaul.tasks.train import publish
from edgehaul.training import registry


class PublishModelParams(BaseModel):
    model_id: RunId
    model_name: Name = "landcover"
    store_block: str = Field(default=StoreBlock.TRAINER)
    min_val_acc: float = Field(default=0.0, ge=0, le=1, description="Refuse models below this final val_acc.")
    min_macro_f1_over_chance: float = Field(
        default=registry.PUBLISH_MARGIN, ge=0, le=1,
        description="Refuse models whose validation macro-F1 is below a uniform-prior guesser's plus this.")
    allow_older: bool = Field(default=False, description="Publish even if trained on an older dataset version "
                              "than the published model (a rollback).")


QualityGateFailed = registry.QualityGateFailed  # the model is below the publish gate


@flow(name="publish_model", log_prints=True,
       flow_run_name=run_namer("publish_model", PublishModelParams, lambda p: f"{p.model_name} {p.model_id}"))
def publish_model(params: PublishModelParams) -> dict[str, Any]:
    """Publish a registered model to the edge; see the module docstring."""
    store = load_block(ObjectStore, params.store_block, param="store_block")
    store_probe.require(store, {"put-if-match-quoted|put-if-match-unquoted": "publish_model (swapping latest.json)"})
    lineage = registry.read_lineage(store, params.model_name, params.model_id)
    if lineage is None:
        raise registry.RegistryError(f"model {params.model_name}/{params.model_id} is not registered")
    registry.check_quality(lineage, params.min_macro_f1_over_chance, params.min_val_acc)
    pointer = publish(store, params.model_name, params.model_id, allow_older=params.allow_older, gate=False)
    if pointer.get("published") is not False:  # a stale model was refused by the task, which logged why
        get_run_logger().info("edge model %s is now %s (was %s)", params.model_name, params.model_id,
                              pointer.get("previous"))
    return pointer
