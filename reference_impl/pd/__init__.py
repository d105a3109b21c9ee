"""Prefill -> decode transfer of the KV cache (phase 2): each prefill rank sends its owned pages
with their logical positions (:mod:`.manifest`); a non-CP decode rebuilds the full layout (:mod:`.transfer`);
or each sends its token shards, per request, to a decode-context-parallel decode (:mod:`.dcp`).
The driver that runs a prefill and a decode end to end is :mod:`reference_impl.prefill_decode`."""

from .dcp import DcpDecodeShard, DcpLayout, transfer_to_dcp
from .manifest import TransferManifest, build_manifest, check_manifests_cover
from .transfer import DecodeCache, pack_pages, receive_pages, send_owned_pages, transfer_in_process

__all__ = [
    "DcpDecodeShard",
    "DcpLayout",
    "DecodeCache",
    "TransferManifest",
    "build_manifest",
    "check_manifests_cover",
    "pack_pages",
    "receive_pages",
    "send_owned_pages",
    "transfer_in_process",
    "transfer_to_dcp",
]
