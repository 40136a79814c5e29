# Sourced by scripts/pagedattn and scripts/test: whether the Release build (preset default,
# build/default) compiles the CUDA backend. Decided once, here, so that both configure the tree the
# same way: a different PAGEDATTN_CUDA between them recompiled the whole library on a fresh clone
# (the README's two commands, the first building the CLI with CUDA when nvcc was found).
# A visible GPU: AUTO (CUDA when nvcc is found); none: OFF (no test could run the kernels, and
# scripts/gpu-check compiles and tests them on a GPU machine).
release_cuda_arg() {
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "a GPU is visible: the Release build compiles the CUDA backend when nvcc is found" >&2
    echo "-DPAGEDATTN_CUDA=AUTO"
  else
    echo "no GPU visible: the Release build is CPU only (PAGEDATTN_CUDA=OFF)" >&2
    echo "-DPAGEDATTN_CUDA=OFF"
  fi
}
