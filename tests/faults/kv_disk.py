"""Faults in the KV disk tier's files (kipp.engine.kv_files): a check skipped on read, a
restore that lands one block off."""

from __future__ import annotations

from faults import Fault, register
from kipp.engine import kv_files

CHECK = "disk tier: restored prefix = uncached, a flipped byte refused"


def _plant_checksum_unchecked(patch):
    original = kv_files.DiskTier._check

    def check(self, data, digest, chunk):
        found = original(self, data, digest, chunk)
        return None if found is kv_files.Bad.CHECKSUM else found

    patch.setattr(kv_files.DiskTier, "_check", check)


def _plant_restore_one_block_on(patch):
    original = kv_files.DiskTier.read_run

    def read_run(self, tokens, start, stop):
        # the hash chain is walked one block too far: block i is restored from block i+1's file
        return original(self, tokens, start + 1, stop + 1)

    patch.setattr(kv_files.DiskTier, "read_run", read_run)


register(Fault(
    name="kv-disk-checksum-unchecked",
    family="KV disk tier",
    where="kipp.engine.kv_files.DiskTier._check",
    description="a block file's checksum is not compared: a flipped byte reaches the slab",
    plant=_plant_checksum_unchecked,
    caught_by=(CHECK,),
))

register(Fault(
    name="kv-disk-restore-one-block-on",
    family="KV disk tier",
    where="kipp.engine.kv_files.DiskTier.read_run",
    description="a restore reads the files of the blocks after the ones it was asked for",
    plant=_plant_restore_one_block_on,
    caught_by=(CHECK,),
))
