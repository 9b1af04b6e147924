"""clients/records.py: the one-copy ArrayRecord codec equals Flower's own, byte for byte and value for value."""
from __future__ import annotations

import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from clients.records import DecodeCache, LazyState, decode_state, decode_tensor, encode_state, encode_tensor


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


def test_lazy_state_checks_on_views_and_copies_an_array_only_when_read() -> None:
    state = _state()
    record = encode_state(state)
    lazy = LazyState(record)
    assert list(lazy) == list(state) and len(lazy) == len(state) and "weight" in lazy and "nope" not in lazy
    message_bytes = np.frombuffer(record["weight"].data, dtype=np.uint8)
    view = lazy.view("weight")
    assert not view.flags.writeable and np.shares_memory(view, message_bytes)  # no copy
    assert np.array_equal(view, state["weight"].numpy())
    tensor = lazy["weight"]
    assert lazy["weight"] is tensor  # decoded once
    assert tensor.numpy().flags.writeable and not np.shares_memory(tensor.numpy(), message_bytes)
    assert np.shares_memory(lazy.view("weight"), tensor.numpy())  # the bytes are let go once decoded
    decoded = decode_state(record)
    for name in state:
        assert torch.equal(lazy[name], decoded[name]) and lazy[name].dtype == decoded[name].dtype
        assert np.array_equal(lazy.view(name), decoded[name].numpy())
    with pytest.raises(KeyError):
        lazy["nope"]


def test_lazy_state_keeps_the_values_as_received() -> None:
    state = _state()
    record = encode_state(state)
    lazy = LazyState(record)
    record["bias"].data = encode_tensor(state["bias"] + 1).data  # a later change to the message's Array
    record["weight"] = encode_tensor(state["weight"] * 2)
    assert torch.equal(lazy["bias"], state["bias"]) and torch.equal(lazy["weight"], state["weight"])


def test_lazy_state_pickles_with_read_and_unread_arrays() -> None:
    state = _state()
    lazy = LazyState(encode_state(state))
    lazy["bias"]
    back = pickle.loads(pickle.dumps(lazy))
    assert list(back) == list(state)
    assert all(torch.equal(back[name], state[name].contiguous()) for name in state)


def test_lazy_state_pickles_while_another_thread_reads_it() -> None:
    """The benchmark pickles a reply for a Ray worker in its attack thread while the server thread may
    be reading (decoding) the same reply: every pickle must succeed and hold the values as received."""
    import sys
    import threading

    state = {f"w{i}": torch.full((4,), float(i)) for i in range(300)}
    record = encode_state(state)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for _ in range(20):
            lazy = LazyState(record)
            reader = threading.Thread(target=lambda: [lazy[name] for name in state])
            reader.start()
            copies = []
            while reader.is_alive():
                copies.append(pickle.loads(pickle.dumps(lazy)))
            reader.join()
            copies.append(pickle.loads(pickle.dumps(lazy)))
            for copy in copies[:: max(1, len(copies) // 5)] + copies[-1:]:
                assert all(torch.equal(copy[name], t) for name, t in state.items())
    finally:
        sys.setswitchinterval(old)


@pytest.mark.parametrize("array", [
    np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
    np.arange(5, dtype=">f8"),
])
def test_lazy_state_views_payloads_outside_the_fast_path_through_flowers_decoder(array: np.ndarray) -> None:
    lazy = LazyState(ArrayRecord(OrderedDict(a=Array.from_numpy_ndarray(array))))
    assert np.array_equal(lazy.view("a"), array) and np.array_equal(lazy["a"].numpy(), array)


def test_a_truncated_payload_is_a_value_error() -> None:
    good = encode_tensor(torch.ones(10))
    cut = Array(dtype=good.dtype, shape=tuple(good.shape), stype=good.stype, data=good.data[:-4])
    lazy = LazyState(ArrayRecord(OrderedDict(a=cut)))
    with pytest.raises(ValueError):
        lazy.view("a")
