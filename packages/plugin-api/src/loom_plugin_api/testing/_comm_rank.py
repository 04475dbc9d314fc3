"""One rank of the communicator tier, in its own interpreter:
``python -m loom_plugin_api.testing._comm_rank RANK WORLD INIT_METHOD PLATFORM_QUALNAME OUT.json``.

It joins ``torch.distributed`` with the platform's ``dist_backend``, builds the platform's
communicator over the world group and writes what each collective returned.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from .._qualname import resolve_obj_by_qualname
from ..context import set_platform_resolver


def main(rank: int, world: int, init_method: str, platform_qualname: str, out: str) -> None:
    platform_cls = resolve_obj_by_qualname(platform_qualname)
    platform = platform_cls()
    set_platform_resolver(lambda: platform)
    device = (
        torch.device(platform_cls.device_type, rank)
        if platform_cls.device_type != "cpu"
        else torch.device("cpu")
    )
    platform_cls.set_device(device)
    kwargs = {"device_id": device} if device.type != "cpu" else {}
    dist.init_process_group(
        platform_cls.dist_backend, init_method=init_method, rank=rank, world_size=world, **kwargs
    )
    try:
        communicator = resolve_obj_by_qualname(platform_cls.get_device_communicator_cls())(
            dist.group.WORLD, device
        )
        results: dict[str, list] = {}
        x = torch.arange(6, dtype=torch.float32, device=device).view(2, 3) + 10 * rank
        results["all_reduce"] = communicator.all_reduce(x.clone()).cpu().tolist()
        results["all_gather_last"] = communicator.all_gather(x.clone(), dim=-1).cpu().tolist()
        results["all_gather_0"] = communicator.all_gather(x.clone(), dim=0).cpu().tolist()
        for src in range(world):
            results[f"broadcast_{src}"] = communicator.broadcast(x.clone(), src=src).cpu().tolist()
        results["world_size_rank"] = [communicator.world_size, communicator.rank]
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    rank, world, init_method, qualname, out = sys.argv[1:6]
    main(int(rank), int(world), init_method, qualname, out)
