"""The bottom floor: what a step is, which every package above shares (the batch, the cache's
geometry and device store, the fp8 format), the options' one declaration, and the errors."""
