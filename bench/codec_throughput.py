"""Flower's ArrayRecord (de)serialisation against ours (clients/records.py) on a DeiT-S state.

    python bench/codec_throughput.py                 # DeiT-S/224 state (88 MB), 7 repeats
    python bench/codec_throughput.py --arch mjp_vit_cifar_patch4_32 --repeats 21

Every message of the paper protocol carries such a state: the weights to each client, a gradient
back to the server. Four sides, each warmed up once, then timed round-robin ``--repeats`` times
(median [min, max] milliseconds, and the ratios of medians): Flower's ``ArrayRecord(state)`` vs
:func:`clients.records.encode_state`, Flower's ``record.to_torch_state_dict()`` vs
:func:`clients.records.decode_state`. The bytes and values are checked equal first. Run with the
benchmark's allocator settings (:func:`fedmjp.allocator.tune_malloc`), as ``run_benchmark.py`` does.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without pip install -e

from fedmjp.allocator import tune_malloc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="mjp_deit_small_patch16_224")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    tune_malloc()
    import torch
    from flwr.app import ArrayRecord

    from clients.records import decode_state, encode_state
    from fedmjp.factory import build_model

    model = build_model({"arch": args.arch, "variant": "plain", "april": None, "checkpoint": None, "seed": 0})
    state = {k: v.detach() for k, v in model.state_dict().items()}
    megabytes = sum(v.numel() * v.element_size() for v in state.values()) / 1e6
    record = ArrayRecord(state)
    ours = encode_state(state)
    if any(record[k].data != ours[k].data for k in state):
        raise SystemExit("encode_state does not write np.save's bytes")
    if any(not torch.equal(a, b) for a, b in zip(record.to_torch_state_dict().values(), decode_state(record).values())):
        raise SystemExit("decode_state does not give Flower's values")
    sides = {
        "encode, Flower ArrayRecord(state)": lambda: ArrayRecord(state),
        "encode, clients.records.encode_state": lambda: encode_state(state),
        "decode, Flower to_torch_state_dict()": lambda: record.to_torch_state_dict(),
        "decode, clients.records.decode_state": lambda: decode_state(record),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t0))
    print(f"{args.arch}: {len(state)} tensors, {megabytes:.0f} MB, {torch.get_num_threads()} torch threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, ms in times.items():
        print(f"  {name:40s} median {statistics.median(ms):6.1f} ms [min {min(ms):.1f}, max {max(ms):.1f}]")
    med = {name: statistics.median(ms) for name, ms in times.items()}
    names = list(sides)
    print(f"ratio Flower / ours: encode {med[names[0]] / med[names[1]]:.2f}x, decode {med[names[2]] / med[names[3]]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
