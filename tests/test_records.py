"""clients/records.py: the one-copy ArrayRecord codec equals Flower's own, byte for byte and value for value."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from clients.records import DecodeCache, decode_state, decode_tensor, encode_state, encode_tensor


def _state() -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(0)
    return OrderedDict([
        ("weight", torch.randn(7, 5, generator=g)),
        ("bias", torch.randn(5, generator=g, dtype=torch.float64)),
        ("scalar", torch.tensor(3.5)),
        ("empty", torch.zeros(0, 3)),
        ("index", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("flag", torch.tensor([True, False, True])),
        ("half", torch.randn(2, 2, generator=g).half()),
        ("sliced", torch.randn(6, 4, generator=g)[::2]),  # not contiguous
    ])


def test_encoded_bytes_are_np_save_output_and_flower_decodes_them() -> None:
    state = _state()
    ours, flowers = encode_state(state), ArrayRecord(state)
    assert list(ours.keys()) == list(flowers.keys()) == list(state)
    for name, tensor in state.items():
        mine, theirs = ours[name], flowers[name]
        assert (mine.dtype, tuple(mine.shape), mine.stype) == (theirs.dtype, tuple(theirs.shape), theirs.stype)
        assert mine.data == theirs.data, name  # C-contiguous inputs: np.save's exact bytes
    for name, tensor in ours.to_torch_state_dict().items():  # Flower's own decoder reads ours
        assert torch.equal(tensor, state[name]) and tensor.dtype == state[name].dtype


def test_decoded_tensors_equal_flowers_and_own_their_memory() -> None:
    state = _state()
    record = ArrayRecord(state)
    ours, flowers = decode_state(record), record.to_torch_state_dict()
    assert list(ours) == list(flowers)
    for name in state:
        assert torch.equal(ours[name], flowers[name]) and ours[name].dtype == flowers[name].dtype
        assert ours[name].numpy().flags.writeable
    ours["weight"].add_(1.0)  # writing to a decoded tensor leaves the message's bytes alone
    assert torch.equal(decode_state(record)["weight"], state["weight"])


@pytest.mark.parametrize("array", [
    np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),  # Fortran order
    np.arange(5, dtype=">f8"),  # non-native byte order
])
def test_payloads_outside_the_fast_path_go_through_flowers_decoder(array: np.ndarray) -> None:
    got = decode_tensor(Array.from_numpy_ndarray(array))
    assert np.array_equal(got.numpy(), array.astype(array.dtype.newbyteorder("=")))


def test_a_fortran_tensor_round_trips() -> None:
    t = torch.randn(4, 6).t()
    assert torch.equal(decode_tensor(encode_tensor(t)), t)


def test_decode_cache_decodes_the_same_payload_once_and_a_new_one_again() -> None:
    state = _state()
    record = encode_state(state)
    cache = DecodeCache()
    first = cache(record)
    assert cache(record) is first  # the same bytes objects: no second decode
    resent = ArrayRecord(OrderedDict((k, record[k]) for k in record))  # the same Arrays in a new record
    assert cache(resent) is first
    changed = encode_state({**state, "bias": state["bias"] + 1})  # equal names, new bytes
    second = cache(changed)
    assert second is not first and torch.equal(second["bias"], state["bias"] + 1)
    fewer = encode_state(OrderedDict(list(state.items())[:2]))
    assert list(cache(fewer)) == ["weight", "bias"]
