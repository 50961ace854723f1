"""``meshrun.runtime.launcher_env.detect()`` under an MPI launcher: the first thing ``meshrun.init()`` does,
without torch's imports (the error paths stop here). Prints what it found."""

from meshrun.runtime.launcher_env import detect

env = detect()
print(
    f"rank {env.rank} of {env.world_size} [{env.kind}] master {env.master_addr}:{env.master_port}"
)
