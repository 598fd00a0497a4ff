"""Our CUDA kernels (*.cu, *.cuh): installed as the package `pagedcli.kernels` (pyproject.toml's
package-dir), so an installed pagedcli finds them with importlib.resources."""
