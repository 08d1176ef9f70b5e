"""A malformed pack sidecar (issue 34): truncated JSON, wrong types, short lists, missing keys,
layers out of range. PackMeta.read refuses it with a PackError (never IndexError / KeyError /
TypeError later, while serving), and open_pack rebuilds the pack from it like a lost sidecar."""
import copy
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moet.checkpoint import open_checkpoint
from moet.errors import PackError
from moet.store import open_pack
from moet.store.pack_file import PackFile, PackMeta


@pytest.fixture(scope="module")
def clean(tmp_path_factory, ds_ckpt):
    """(checkpoint, pack dir, paths, the valid sidecar as a dict, its checksums)."""
    d = str(tmp_path_factory.mktemp("sidecar"))
    with open_pack(open_checkpoint(ds_ckpt), d) as p:
        paths, sums = p.paths, {k: list(v) for k, v in p.meta.checksums.items()}
    return ds_ckpt, d, paths, json.load(open(paths.sidecar)), sums


def _set(d: dict, path: tuple, value) -> dict:
    d = copy.deepcopy(d)
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return d


def _drop(d: dict, path: tuple) -> dict:
    d = copy.deepcopy(d)
    node = d
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return d


def _cases(side: dict) -> dict[str, str]:
    """name -> sidecar text."""
    text = json.dumps(side)
    d = {
        "truncated": text[: len(text) // 2],
        "empty": "",
        "not_utf8": "\xff\xfe{",
        "a_list": "[]",
        "short_checksum_list": _set(side, ("checksums", "1"), side["checksums"]["1"][:3]),
        "checksum_not_string": _set(side, ("checksums", "0"), [7] * len(side["checksums"]["0"])),
        "checksums_missing_a_layer": _drop(side, ("checksums", "2")),
        "layer_out_of_range": _set(side, ("layers_written",), [0, 1, 2, 9]),
        "layer_repeated": _set(side, ("layers_written",), [0, 1, 1]),
        "layer_as_string": _set(side, ("layers_written",), [0, 1, "2"]),
        "num_experts_string": _set(side, ("num_experts",), str(side["num_experts"])),
        "num_experts_zero": _set(side, ("num_experts",), 0),
        "stride_zero": _set(side, ("row", "stride"), 0),
        "fields_not_a_list": _set(side, ("row", "fields"), {"name": "x"}),
        "field_outside_row": _set(side, ("row", "fields", 0, "offset"), 10**9),
        "no_layers": _drop(side, ("layers",)),
        "layers_empty": _set(side, ("layers",), []),
        "unknown_key": _set(side, ("surprise",), 1),
        "checksums_a_list": _set(side, ("checksums",), []),
    }
    return {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in d.items()}


CASE_NAMES = ["truncated", "empty", "not_utf8", "a_list", "short_checksum_list", "checksum_not_string",
              "checksums_missing_a_layer", "layer_out_of_range", "layer_repeated", "layer_as_string",
              "num_experts_string", "num_experts_zero", "stride_zero", "fields_not_a_list", "field_outside_row",
              "no_layers", "layers_empty", "unknown_key", "checksums_a_list"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_malformed_sidecar_refused_then_pack_rebuilt(clean, case):
    ckpt, d, paths, side, sums = clean
    with open(paths.sidecar, "w", encoding="latin-1") as f:
        f.write(_cases(side)[case])
    with pytest.raises(PackError, match="sidecar") as e:
        PackMeta.read(paths.sidecar)
    assert "\n" not in str(e.value) and paths.sidecar in str(e.value)
    with open_pack(open_checkpoint(ckpt), d) as p:                  # rebuilt, whole, readable
        assert p.built_layers == len(p.meta.layers) and p.meta.complete
        assert {k: list(v) for k, v in p.meta.checksums.items()} == sums
        buf = memoryview(bytearray(p.stride))
        for l in range(p.num_layers):
            for e in range(p.num_experts):
                p.read_row_into(l, e, buf)


# ---------------------------------------------------------------------------- fuzz

VALUES = st.sampled_from([None, -1, 0, 1, 3, 10**12, 1.5, float("inf"), "", "x", "0", True, [], [0], [-1], {}, {"0": []}])


@st.composite
def mutated(draw, side: dict):
    """The valid sidecar with one value somewhere replaced, removed, or one list cut short."""
    d = copy.deepcopy(side)
    node, key = d, None
    path = []
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        path.append(key)
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or draw(st.booleans()):
            break
        node = child
    action = draw(st.sampled_from(["set", "drop", "cut"]))
    if key is None:
        return d
    if action == "set":
        node[key] = draw(VALUES)
    elif action == "drop":
        del node[key]
    elif isinstance(node[key], list) and node[key]:
        node[key] = node[key][: draw(st.integers(0, len(node[key]) - 1))]
    else:
        node[key] = draw(VALUES)
    return d


def test_fuzzed_sidecars_are_refused_or_safe(clean):
    ckpt, d, paths, side, sums = clean
    buf = memoryview(bytearray(side["row"]["stride"]))

    @given(st.data())
    def check(data):
        doc = data.draw(mutated(side))
        try:
            meta = PackMeta.from_dict(doc, "fuzzed sidecar")
        except PackError as exc:
            assert "\n" not in str(exc)
            return
        # accepted: every use of it is well defined, and reading the pack through it can only
        # fail with a PackError (a checksum that no longer matches, a layer never written)
        meta.key(), meta.complete, meta.file_bytes, meta.layout, meta.to_json()
        assert all(len(meta.checksums[str(l)]) == meta.num_experts for l in meta.layers_written)
        try:
            pf = PackFile(paths, meta)
        except PackError:
            return
        with pf:
            for l in range(len(meta.layers)):
                for e in range(meta.num_experts):
                    try:
                        pf.read_row_into(l, e, buf)
                    except PackError:
                        pass

    check()
