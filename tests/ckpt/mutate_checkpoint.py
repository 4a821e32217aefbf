"""Damages one checkpoint step in one way, for test_ckpt_mutation.sh (runs under /usr/bin/python3,
which has h5py).

  mutate_checkpoint.py list                 the damage kinds, one per line
  mutate_checkpoint.py KIND STEP_DIR        applies KIND to STEP_DIR; prints what the tools must
                                            name in their error line: "FILE TENSOR" (TENSOR "-"
                                            when the damage is not one tensor's)
"""
import json
import os
import sys

import h5py
import numpy as np

MANIFEST = "/_elastrun/manifest"
SHARD = "shard-00001-of-00004.h5"
TENSOR = "model/w"  # sharded: rank 1 holds a piece of it in SHARD


def read_manifest(step):
    with h5py.File(os.path.join(step, "index.h5"), "r") as f:
        return f[MANIFEST][()].rstrip(b"\0")


def write_manifest(step, text):
    with h5py.File(os.path.join(step, "index.h5"), "r+") as f:
        del f[MANIFEST]
        f.create_dataset(MANIFEST, data=np.bytes_(text))


def edit_manifest(step, edit):
    m = json.loads(read_manifest(step))
    edit(m)
    write_manifest(step, json.dumps(m).encode())


def tensor_entry(m, name=TENSOR):
    return next(t for t in m["tensors"] if t["name"] == name)


def flip(path, offset, count=1):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(count))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def data_offset(step):
    with h5py.File(os.path.join(step, SHARD), "r") as f:
        return f[TENSOR].id.get_offset()


def shard(step):
    return os.path.join(step, SHARD)


def index(step):
    return os.path.join(step, "index.h5")


KINDS = {
    # bytes
    "flip_data_byte": lambda s: (flip(shard(s), data_offset(s)), (SHARD, TENSOR))[1],
    "flip_superblock": lambda s: (flip(shard(s), 0, 8), (SHARD, "-"))[1],
    "flip_index_superblock": lambda s: (flip(index(s), 0, 8), ("index.h5", "-"))[1],
    # truncation
    "truncate_shard": lambda s: (os.truncate(shard(s), os.path.getsize(shard(s)) // 2), (SHARD, "-"))[1],
    "truncate_index": lambda s: (os.truncate(index(s), 100), ("index.h5", "-"))[1],
    "empty_shard": lambda s: (os.truncate(shard(s), 0), (SHARD, "-"))[1],
    # deletion
    "delete_shard": lambda s: (os.remove(shard(s)), (SHARD, "-"))[1],
    "delete_index": lambda s: (os.remove(index(s)), ("index.h5", "-"))[1],
    # permissions (the test runs the readers as an unprivileged user when it is root)
    "unreadable_shard": lambda s: (os.chmod(shard(s), 0), (SHARD, "-"))[1],
    "unreadable_index": lambda s: (os.chmod(index(s), 0), ("index.h5", "-"))[1],
    # manifest fields: wrong type
    "world_size_string": lambda s: (edit_manifest(s, lambda m: m.update(world_size="4")), ("index.h5", "-"))[1],
    "shape_not_array": lambda s: (edit_manifest(s, lambda m: tensor_entry(m).update(shape="10x7")),
                                  ("index.h5", TENSOR))[1],
    "xxh3_negative": lambda s: (edit_manifest(s, lambda m: tensor_entry(m)["shards"][0].update(xxh3=-1)),
                                ("index.h5", TENSOR))[1],
    "tensors_object": lambda s: (edit_manifest(s, lambda m: m.update(tensors={})), ("index.h5", "-"))[1],
    "unknown_dtype": lambda s: (edit_manifest(s, lambda m: tensor_entry(m).update(dtype="float128")),
                                ("index.h5", TENSOR))[1],
    # manifest fields: wrong size
    "extent_too_large": lambda s: (edit_manifest(s, lambda m: tensor_entry(m)["shards"][0].update(extent=[11, 7])),
                                   ("index.h5", TENSOR))[1],
    "shape_huge": lambda s: (edit_manifest(s, lambda m: tensor_entry(m).update(shape=[2**40, 2**40])),
                             ("index.h5", TENSOR))[1],
    "shard_missing": lambda s: (edit_manifest(s, lambda m: tensor_entry(m)["shards"].pop()), ("index.h5", TENSOR))[1],
    "rank_outside_world": lambda s: (edit_manifest(s, lambda m: tensor_entry(m)["shards"][0].update(rank=99)),
                                     ("index.h5", TENSOR))[1],
    "shard_file_escapes": lambda s: (edit_manifest(s, lambda m: m["files"][0].update(name="../../etc/passwd")),
                                     ("index.h5", "-"))[1],
    # manifest: depth and encoding
    "metadata_deep": lambda s: (write_manifest(s, read_manifest(s).replace(
        b'"metadata":', b'"metadata":' + b"[" * 100000 + b"]" * 100000 + b',"x":', 1)), ("index.h5", "-"))[1],
    "name_invalid_utf8": lambda s: (write_manifest(s, read_manifest(s).replace(
        TENSOR.encode(), b"model/\xff\xfe", 1)), ("index.h5", "-"))[1],
    "manifest_not_json": lambda s: (write_manifest(s, read_manifest(s)[:-7]), ("index.h5", "-"))[1],
    "manifest_newline_in_string": lambda s: (write_manifest(s, read_manifest(s).replace(
        b'"layout":"', b'"layout":"\n', 1)), ("index.h5", "-"))[1],
}


def main():
    if sys.argv[1:] == ["list"]:
        print("\n".join(KINDS))
        return
    kind, step = sys.argv[1], sys.argv[2]
    file, tensor = KINDS[kind](step)
    print(file, tensor)


if __name__ == "__main__":
    main()
