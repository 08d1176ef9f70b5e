"""Number formats of the expert path: pure tensor functions, CPU or GPU, no model knowledge.

  e2m1       FP4 element codes (16 values incl. -0)
  fp8        e4m3fn / e5m2 casts with saturation, UE8M0 scale bytes
  nvfp4      modelopt NVFP4 checkpoint layout (encode / decode)
  mxfp4      gpt-oss MXFP4 checkpoint layout (encode / decode)
  fp8_block  DeepSeek FP8 block-128 checkpoint layout (encode / decode)
  w2         moet's sign-symmetric 2-bit code and the f64-exact re-quantization
Byte-level layouts: docs/formats.md.
"""
from moet.formats import e2m1, fp8, fp8_block, mxfp4, nvfp4, w2

__all__ = ["e2m1", "fp8", "fp8_block", "mxfp4", "nvfp4", "w2"]
