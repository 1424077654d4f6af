"""PyTorch with a CUDA GPU, for the dev/gpu peer scripts (run as scripts, so
this directory is on their path)."""


def cuda_torch():
    """torch, or None after a SKIPPED line saying why it cannot run here."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(f"SKIPPED: torch not importable ({e})")
        return None
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU for torch")
        return None
    return torch
