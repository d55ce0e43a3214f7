"""Count the public members of stallfree.Scheduler: its face (class members and instance attributes) and
the deprecated aliases kept for one release (stallfree.core.aliases).

Run: PYTHONPATH=src python benchmarks/scheduler_face.py [--names]
Before the face was narrowed the same count read 47 class members (64 with the instance attributes).
"""

from __future__ import annotations

import argparse

from stallfree import Scheduler

try:
    from stallfree.core.aliases import deprecated_aliases
except ImportError:  # a tree from before the aliases
    def deprecated_aliases(cls: type) -> list[str]:
        return []


def face() -> tuple[list[str], list[str], list[str]]:
    """(class members, instance attributes, deprecated aliases) of a Scheduler, public names only, sorted."""
    aliases = deprecated_aliases(Scheduler)
    cls = sorted(n for n in dir(Scheduler) if not n.startswith("_") and n not in aliases)
    s = Scheduler(token_budget=8, max_seqs=4, kv_tokens=100)
    inst = sorted(n for n in vars(s) if not n.startswith("_") and n not in cls)
    return cls, inst, aliases


def main() -> None:
    """Print the counts (and with --names the names)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", action="store_true")
    args = ap.parse_args()
    cls, inst, aliases = face()
    print(f"class members {len(cls)}, instance attributes {len(inst)}, face {len(cls) + len(inst)}, "
          f"deprecated aliases {len(aliases)}")
    if args.names:
        print("face:", " ".join(cls + inst))
        print("aliases:", " ".join(aliases))


if __name__ == "__main__":
    main()
