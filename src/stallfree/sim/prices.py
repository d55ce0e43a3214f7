"""Former path of `stallfree.sim.inputs.prices`, kept for one release: import from the new path.

GPU prices and availability for `stallfree plan`: US dollars per GPU-hour from the user's flags or file, and the
most GPUs of a type to buy. Every public name this module had is re-exported from where it lives now; the module
goes in the next release.
"""

from stallfree.sim.inputs.prices import GpuPrice, PriceError, gpu_key, load_prices, parse_gpu_prices, parse_max_gpus

__all__ = [
    "GpuPrice",
    "PriceError",
    "gpu_key",
    "load_prices",
    "parse_gpu_prices",
    "parse_max_gpus",
]
