"""python -m mok: what this installation has (library, engine, NCCL, and torch when present)."""

from __future__ import annotations

import importlib.util

import mok


def main() -> None:
    print(mok.engine_info())
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed (mok.torch needs it: pip install mok[torch])")
        return
    import torch

    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs visible: "
          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")


if __name__ == "__main__":
    main()
