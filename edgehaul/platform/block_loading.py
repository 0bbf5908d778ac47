"""Load a block document by name, typed, with an error that says which block is missing and what to do.

`Block.load` is typed "the block or a coroutine" (it dispatches on the calling context), which put a
`cast` beside every call, and a missing document raises Prefect's bare "Unable to find block
document named X for block type Y". Flows, tasks and the dev harness load blocks through here.
"""

from __future__ import annotations

from typing import TypeVar

from prefect.blocks.core import Block
from prefect.exceptions import ObjectNotFound

B = TypeVar("B", bound=Block)

BLOCKS_DOC = "infra/README.md#blocks"


class BlockNotFoundError(ValueError):
    """No block document of this type and name on the API server (a ValueError, as Prefect's own)."""


def _api_url() -> str:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or "a temporary local server (PREFECT_API_URL is not set)"


def not_found(cls: type[Block], name: str, param: str | None = None) -> BlockNotFoundError:
    how = f" or pass {param}=<the name of an existing {cls.__name__} block>" if param else ""
    return BlockNotFoundError(
        f"{cls.__name__} block {name!r} (type {cls.get_block_type_slug()!r}) not found on {_api_url()}: "
        f"create it (roles and names: {BLOCKS_DOC}; the local stack: `make deploy`){how}"
    )


def load_block(cls: type[B], name: str, *, param: str | None = None) -> B:
    """`cls.load(name)` from synchronous code (flows, tasks, scripts), typed as `cls`.

    `param` names the flow parameter that chose the block, for the error message.
    Raises BlockNotFoundError when no such document exists.
    """
    try:
        block = cls.load(name)
    except ValueError as e:
        if isinstance(e.__cause__, ObjectNotFound):
            raise not_found(cls, name, param) from e
        raise
    if not isinstance(block, cls):  # a coroutine: called from async code, where load dispatches to aload
        block.close()
        raise TypeError(f"load_block({cls.__name__}, {name!r}) was called from async code: use aload_block")
    return block


async def aload_block(cls: type[B], name: str, *, param: str | None = None) -> B:
    """The same from async code."""
    try:
        return await cls.aload(name)
    except ValueError as e:
        if isinstance(e.__cause__, ObjectNotFound):
            raise not_found(cls, name, param) from e
        raise
