"""Batch construction, column access, select/pop/union, devices and copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from protocol_asserts import assert_batches_equal
from tensordict import TensorDict

from megarl.errors import DataError, MegarlError
from megarl.protocol import Batch, MissingKeyError

pytestmark = pytest.mark.unit


def make_batch() -> Batch:
    return Batch.from_dict(
        tensors={
            "input_ids": torch.arange(12).reshape(4, 3),
            "response_mask": torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]),
        },
        non_tensors={"uid": ["p0", "p1", "p0", "p2"], "extra_info": [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}]},
        meta={"temperature": 0.7, "step": 3},
    )


def test_from_dict_stores_columns_and_meta() -> None:
    batch = make_batch()
    assert len(batch) == batch.batch_size == 4
    assert batch.tensors.batch_size == torch.Size([4])
    assert batch.keys() == ["input_ids", "response_mask", "uid", "extra_info"]
    assert batch.tensor_keys == ["input_ids", "response_mask"]
    assert batch.non_tensor_keys == ["uid", "extra_info"]
    assert batch["input_ids"][2].tolist() == [6, 7, 8]
    uid = batch["uid"]
    assert isinstance(uid, np.ndarray) and uid.dtype == object and uid.shape == (4,)
    assert uid.tolist() == ["p0", "p1", "p0", "p2"]
    assert batch.meta == {"temperature": 0.7, "step": 3}
    assert "uid" in batch and "input_ids" in batch and "nope" not in batch and 3 not in batch


def test_lists_per_row_stay_single_values() -> None:
    # np.array would make a (2, 2) array from equal-length lists; a column must stay (B,).
    batch = Batch.from_dict(non_tensors={"raw_prompt": [[1, 2], [3, 4]], "arr": np.array(["a", "b"])})
    assert batch["raw_prompt"].shape == (2,) and batch["raw_prompt"][1] == [3, 4]
    assert batch["arr"].dtype == object and type(batch["arr"][0]) is str


def test_accepts_a_tensordict_and_keeps_its_batch_size() -> None:
    batch = Batch.from_dict(TensorDict({"x": torch.zeros(3, 2)}, batch_size=[3]))
    assert len(batch) == 3
    assert len(Batch(TensorDict({}, batch_size=[5]))) == 5


def test_empty_batch() -> None:
    batch = Batch.from_dict({})
    assert len(batch) == 0 and batch.keys() == [] and batch.meta == {}
    assert len(Batch(non_tensors={"uid": []})) == 0


def test_length_mismatch_names_the_column() -> None:
    with pytest.raises(DataError, match=r"column 'mask' has 3 rows, but column 'ids' has 4"):
        Batch.from_dict({"ids": torch.zeros(4, 2), "mask": torch.zeros(3, 2)})
    with pytest.raises(DataError, match=r"column 'uid' has 2 rows, but column 'ids' has 4"):
        Batch.from_dict({"ids": torch.zeros(4)}, {"uid": ["a", "b"]})
    with pytest.raises(DataError, match=r"column 'ids' has 4 rows, but batch_size has 5"):
        Batch({"ids": torch.zeros(4)}, batch_size=5)


@pytest.mark.parametrize(
    ("tensors", "non_tensors", "message"),
    [
        ({"x": torch.tensor(1.0)}, None, r"tensor column 'x' is a scalar"),
        ({"x": [1, 2]}, None, r"tensor column 'x' is a list, not a torch.Tensor"),
        ({"x": torch.zeros(2)}, {"x": ["a", "b"]}, r"columns \['x'\] are given both"),
        (None, {"u": np.zeros((2, 2))}, r"non-tensor column 'u' must be 1-D .* shape \(2, 2\)"),
        (None, {"u": torch.zeros(2)}, r"non-tensor column 'u' is a torch.Tensor"),
        (None, {"u": "ab"}, r"non-tensor column 'u' must be a list .* got str"),
        ({1: torch.zeros(2)}, None, r"names must be str, got 1"),
    ],
)
def test_bad_columns_raise(tensors: object, non_tensors: object, message: str) -> None:
    with pytest.raises(DataError, match=message):
        Batch.from_dict(tensors, non_tensors)  # type: ignore[arg-type]


def test_nested_tensordict_is_refused() -> None:
    nested = TensorDict({"inner": TensorDict({"a": torch.zeros(2)}, batch_size=[2])}, batch_size=[2])
    with pytest.raises(DataError, match=r"'inner' is a TensorDict.*nested TensorDicts are not supported"):
        Batch.from_dict(nested)


def test_meta_must_be_a_dict() -> None:
    with pytest.raises(DataError, match=r"meta must be a dict, got list"):
        Batch.from_dict({}, None, [1])  # type: ignore[arg-type]


def test_missing_column_lists_available_keys() -> None:
    batch = make_batch()
    with pytest.raises(MissingKeyError) as caught:
        batch["values"]
    message = str(caught.value)
    assert message == (
        "key 'values' is not in the batch; available keys: "
        "['extra_info', 'input_ids', 'response_mask', 'uid']"
    )
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, MegarlError)


def test_setitem_adds_replaces_and_switches_column_kind() -> None:
    batch = make_batch()
    batch["advantages"] = torch.ones(4, 2)
    batch["data_source"] = ["a", "b", "c", "d"]
    assert batch.tensor_keys[-1] == "advantages" and batch["data_source"].tolist() == ["a", "b", "c", "d"]
    batch["uid"] = torch.tensor([0, 1, 0, 2])  # non-tensor -> tensor
    assert "uid" in batch.tensor_keys and "uid" not in batch.non_tensors
    batch["uid"] = ["x"] * 4  # and back
    assert "uid" not in batch.tensor_keys and batch["uid"].tolist() == ["x"] * 4
    with pytest.raises(DataError, match=r"column 'bad' has shape \(3,\), but the batch has 4 rows"):
        batch["bad"] = torch.zeros(3)
    with pytest.raises(DataError, match=r"column 'bad' has 2 rows, but the batch has 4"):
        batch["bad"] = ["a", "b"]


def test_select_keeps_named_columns_as_views() -> None:
    batch = make_batch()
    picked = batch.select("uid", "input_ids")
    assert picked.tensor_keys == ["input_ids"] and picked.non_tensor_keys == ["uid"]
    assert picked.meta == batch.meta and picked.meta is not batch.meta
    picked["input_ids"][0, 0] = 100
    assert batch["input_ids"][0, 0] == 100  # rows are shared ...
    picked["new"] = torch.zeros(4)
    assert "new" not in batch  # ... but the column dicts are not
    assert len(batch.select()) == 4 and batch.select().keys() == []


def test_select_and_pop_errors_name_the_key() -> None:
    batch = make_batch()
    with pytest.raises(KeyError, match=r"key 'values' is not in the batch; available keys: \['extra_info'"):
        batch.select("input_ids", "values")
    with pytest.raises(KeyError, match=r"key 'values' is not in the batch"):
        batch.pop("uid", "values")
    assert "uid" in batch  # nothing was removed
    with pytest.raises(TypeError, match=r"pass names as separate arguments"):
        batch.select(["uid"])  # type: ignore[arg-type]


def test_pop_removes_and_returns_columns() -> None:
    batch = make_batch()
    popped = batch.pop("response_mask", "uid")
    assert batch.keys() == ["input_ids", "extra_info"]
    assert popped.keys() == ["response_mask", "uid"]
    assert popped["uid"].tolist() == ["p0", "p1", "p0", "p2"]
    assert popped["response_mask"].sum().item() == 4.0


def test_union_merges_columns_and_meta() -> None:
    left = make_batch()
    right = Batch.from_dict(
        {"input_ids": left["input_ids"].clone(), "values": torch.full((4, 2), 0.5)},
        {"uid": ["p0", "p1", "p0", "p2"], "score": [1, 0, 1, 0]},
        {"step": 3, "kl_coef": 0.1},
    )
    merged = left.union(right)
    assert sorted(merged.keys()) == sorted(
        ["input_ids", "response_mask", "values", "uid", "extra_info", "score"]
    )
    assert merged.meta == {"temperature": 0.7, "step": 3, "kl_coef": 0.1}
    assert merged["values"][3].tolist() == [0.5, 0.5] and merged["score"].tolist() == [1, 0, 1, 0]
    assert "values" not in left and "score" not in left  # union returns a new batch


def test_union_accepts_equal_nan_and_array_values() -> None:
    x = torch.tensor([float("nan"), 1.0])
    arrays = np.empty(2, dtype=object)
    arrays[:] = [np.arange(2), np.arange(3)]
    a = Batch.from_dict({"x": x}, {"a": arrays})
    b = Batch.from_dict({"x": x.clone()}, {"a": np.array([np.arange(2), np.arange(3)], dtype=object)})
    assert len(a.union(b)) == 2


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (Batch.from_dict({"input_ids": torch.zeros(3, 3, dtype=torch.int64)}), r"union batches of 4 and 3 rows"),
        (
            Batch.from_dict({"input_ids": torch.arange(12).reshape(4, 3).flip(0)}),
            r"column 'input_ids' differs between the batches \(values differ first at row 0\)",
        ),
        (
            Batch.from_dict({"input_ids": torch.arange(12.0).reshape(4, 3)}),
            r"column 'input_ids' differs between the batches \(dtype torch.int64 vs torch.float32\)",
        ),
        (
            Batch.from_dict(non_tensors={"uid": ["p0", "p1", "p9", "p2"]}),
            r"column 'uid' differs between the batches at row 2 \('p0' vs 'p9'\)",
        ),
        (Batch.from_dict(non_tensors={"input_ids": [0] * 4}), r"'input_ids' is a tensor in this batch"),
        (Batch.from_dict({"uid": torch.zeros(4)}), r"'uid' is a non-tensor in this batch"),
        (Batch.from_dict(non_tensors={"uid": ["p0", "p1", "p0", "p2"]}, meta={"step": 4}), r"meta\['step'\] conflicts: 3 .* 4"),
    ],
)
def test_union_errors_name_the_key(other: Batch, message: str) -> None:
    with pytest.raises(DataError, match=message):
        make_batch().union(other)


def test_to_moves_tensors_and_keeps_the_rest() -> None:
    batch = make_batch()
    moved = batch.to("cpu")
    assert moved.tensors.device == torch.device("cpu")
    assert moved["uid"] is batch["uid"] and moved.meta == batch.meta
    assert "device=cpu" in repr(moved)


def test_clone_copies_everything() -> None:
    batch = make_batch()
    copied = batch.clone()
    assert_batches_equal(copied, batch)
    copied["input_ids"][0, 0] = -1
    copied["extra_info"][0]["i"] = 99
    copied.meta["step"] = 10
    assert batch["input_ids"][0, 0] == 0 and batch["extra_info"][0] == {"i": 0} and batch.meta["step"] == 3


def test_repr_lists_columns_shapes_and_dtypes() -> None:
    text = repr(make_batch())
    assert text.startswith("Batch(batch_size=4,")
    assert "input_ids: int64[4, 3]" in text and "response_mask: float32[4, 2]" in text
    assert "uid: object[4]" in text and "meta keys=['temperature', 'step']" in text


def test_a_batch_is_not_iterable() -> None:
    with pytest.raises(TypeError, match=r"batch.keys\(\) for columns, batch.split\(1\) for rows"):
        list(make_batch())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_indexes_pickles_and_writes_arrow() -> None:
    import pickle

    batch = make_batch().to("cuda")
    assert batch["input_ids"].is_cuda and batch.tensors.device.type == "cuda"
    picked = batch[torch.tensor([3, 0])]
    assert picked["input_ids"].is_cuda and picked["input_ids"][0].tolist() == [9, 10, 11]
    joined = Batch.concat(batch.chunk(2))
    assert joined.tensors.device == batch.tensors.device
    assert_batches_equal(pickle.loads(pickle.dumps(batch[1:3])).to("cpu"), make_batch()[1:3])
    assert_batches_equal(Batch.from_arrow(batch.to_arrow()), make_batch())
    assert len(batch.union(make_batch().select("uid"))) == 4
