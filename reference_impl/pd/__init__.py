"""Prefill -> decode transfer of the KV cache (phase 2): each prefill rank sends its owned pages
with their logical positions (:mod:`.plan`); a non-CP decode rebuilds the full layout (:mod:`.transfer`)."""

from .plan import TransferPlan, build_transfer_plan, check_plans_cover
from .transfer import (
    DecodeCache,
    PDResult,
    oracle_mismatches,
    pack_pages,
    receive_pages,
    run_prefill_and_decode,
    send_owned_pages,
    transfer_in_process,
)

__all__ = [
    "DecodeCache",
    "PDResult",
    "TransferPlan",
    "build_transfer_plan",
    "check_plans_cover",
    "oracle_mismatches",
    "pack_pages",
    "receive_pages",
    "run_prefill_and_decode",
    "send_owned_pages",
    "transfer_in_process",
]
