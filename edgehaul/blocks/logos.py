"""Block type logos the UI can show offline.

The third-party block types the product saves (prefect-aws's `s3-bucket` / `aws-credentials` for the core's
cached results, Prefect's `custom-webhook` for alerts) name logos on the internet (cdn.sanity.io,
raw.githubusercontent.com): on an offline site the Blocks page shows them as broken images. A `data:` URI
is no way out: the server stores any string, but every Prefect client validates a block type's `logo_url`
as an http(s) URL, so loading any block of that type would fail. So the logo is cleared, and the UI draws
those rows as it draws ours (edgehaul's own block types name no logo). Saving such a block puts the URL back
(`Block.save` registers its class's type), as does the server's block registration at start-up: call this
after the saves (`edgehaul blocks apply` and the alert automations do).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# block type slug -> why the product has it
UNREACHABLE = {"s3-bucket": "core cached results", "aws-credentials": "its credentials",
               "custom-webhook": "alert notifications"}


def clear_unreachable_logos(slugs: tuple[str, ...] = tuple(UNREACHABLE)) -> list[str]:
    """Clear the internet logo of each of these block types on the server; returns the slugs changed
    (a type the server does not have, or one with no logo, is left alone)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import BlockTypeUpdate
    from prefect.exceptions import ObjectNotFound

    changed = []
    with get_client(sync_client=True) as client:
        for slug in slugs:
            try:
                bt = client.read_block_type_by_slug(slug)
            except ObjectNotFound:
                continue
            if bt.logo_url is None:
                continue
            client.update_block_type(bt.id, BlockTypeUpdate(logo_url=None))
            changed.append(slug)
    if changed:
        log.info("block logos: cleared %d that load only online (%s)", len(changed), ", ".join(changed))
    return changed
