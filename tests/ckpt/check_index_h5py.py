"""Reads an elastrun checkpoint index with plain h5py and compares against expected bytes.

Usage: /usr/bin/python3 check_index_h5py.py FIXTURE_DIR   (run from an unrelated cwd: VDS source
files must resolve relative to the index file)."""
import json
import os
import sys

import h5py
import numpy as np

NUMPY = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
         "float64": np.float64, "int8": np.int8, "int16": np.int16, "int32": np.int32,
         "int64": np.int64, "uint8": np.uint8, "bool": np.bool_}


def main(root):
    expected = json.load(open(os.path.join(root, "expected.json")))
    index_path = os.path.join(root, "ckpt", "latest", "index.h5")
    failures = []
    with h5py.File(index_path, "r") as f:
        assert f.attrs["format_version"] == 1, f.attrs["format_version"]
        assert f.attrs["step"] == 42 and f.attrs["world_size"] == 4
        assert json.loads(f["_elastrun/user_metadata"][()])["step_meta"] == 42
        manifest = json.loads(f["_elastrun/manifest"][()])
        assert len(manifest["tensors"]) == len(expected)
        for name, spec in expected.items():
            want = np.frombuffer(open(os.path.join(root, spec["file"]), "rb").read(),
                                 dtype=NUMPY[spec["dtype"]]).reshape(spec["shape"])
            ds = f[name]
            if ds.attrs["dtype"].decode() != spec["dtype"]:
                failures.append(f"{name}: dtype attribute {ds.attrs['dtype']!r}")
            if ds.dtype != want.dtype:
                failures.append(f"{name}: h5py dtype {ds.dtype} != {want.dtype}")
            if list(ds.shape) != spec["shape"]:
                failures.append(f"{name}: shape {ds.shape} != {spec['shape']}")
                continue
            got = ds[()]
            if np.asarray(got).tobytes() != want.tobytes():
                failures.append(f"{name}: full read differs")
            if want.ndim >= 1 and want.shape[0] >= 3:
                if ds[1:3].tobytes() != want[1:3].tobytes():
                    failures.append(f"{name}: slice [1:3] differs")
            if want.ndim == 2 and want.shape[1] >= 3:
                if ds[:, 1:3].tobytes() != want[:, 1:3].tobytes():
                    failures.append(f"{name}: column slice differs")
    for line in failures:
        print("FAIL", line)
    print(f"checked {len(expected)} tensors, {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
