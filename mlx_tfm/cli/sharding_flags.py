"""``--pipeline`` and ``--tensor-parallel`` for generate, chat and server: split the model
over the ranks ``mlx.launch`` started (``mlx_tfm.distributed``). Rank 0 reads the input,
prints and serves; the other ranks hold their part of the model and follow it."""

from __future__ import annotations

FLAGS = {"pipeline": "--pipeline", "tensor": "--tensor-parallel"}


def add_arguments(parser) -> None:
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--pipeline", action="store_true",
                       help="under mlx.launch: each rank holds a block of the model's layers (reads only those)")
    split.add_argument("--tensor-parallel", action="store_true",
                       help="under mlx.launch: each rank holds a slice of every layer's matrices")


def mode(args) -> str | None:
    """"pipeline", "tensor", or None (the whole model in this process)."""
    return "pipeline" if args.pipeline else "tensor" if args.tensor_parallel else None


def join(args, refused: dict | None = None):
    """The ranks to split the model over (``World``), or the one-process world without a
    split flag. One line for a split flag in a single process, a launch of several
    ranks without one, adapters not fused, or a flag in ``refused`` ({flag: given}) set."""
    from ..distributed.launch import launch_from
    from ..distributed.world import ONE_PROCESS, join
    from ..errors import UserError

    split = mode(args)
    if split is None:
        launch = launch_from()
        if launch is not None:
            raise UserError(f"started as rank {launch.rank} of {launch.size} by a launcher: pass --pipeline or "
                            "--tensor-parallel to split the model over the ranks")
        return ONE_PROCESS
    flag = FLAGS[split]
    if args.adapter_path:
        raise UserError(f"{flag} with --adapter-path: fuse the adapters into the model first (mlx-tfm fuse)")
    for other, given in (refused or {}).items():
        if given:
            raise UserError(f"{other} is not supported with {flag}")
    world = join()
    if world.size == 1:
        raise UserError(f"{flag} splits the model over the processes mlx.launch starts, and this is one process "
                        "(e.g. mlx.launch -n 2 -- mlx-tfm ...; docs/distributed.md)")
    return world


def splitter(args, world):
    """What ``load(..., shard=)`` takes for these flags."""
    from ..distributed.sharding import splitter

    return splitter(mode(args), world)


def seed_alike(world, seed: int | None) -> None:
    """Seed MLX's random state; with several ranks, all with rank 0's seed (one drawn
    when none is given), so every rank samples the same tokens."""
    import secrets

    import mlx.core as mx

    if world.size > 1:
        seed = world.share(seed if seed is not None else secrets.randbits(31) if world.leader else None)
    if seed is not None:
        mx.random.seed(seed)
