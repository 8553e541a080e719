"""Arms I and J's machinery: the forward computed as vLLM computes it, one module per concern.

- :mod:`.form`: the forward in plain torch, each piece in HF's form, vLLM's form in torch, or vLLM's kernel
  (:class:`~.form.VllmForm`, ``gap.i_pieces`` parsed by :func:`~.form.parse_form`); torch only;
- :mod:`.kernels`: vLLM's own CUDA/Triton kernels loaded into a :class:`~.form.Kernels` object, and vLLM's
  batch-invariant mode confined to where it belongs;
- :mod:`.autograd`: backward passes for the kernel pieces that have none (arm J trains through them);
- :mod:`.versions`: the vLLM releases the plugin supports and the one check of the installed vLLM.

The scoring plan that runs this forward over a bf16 shadow or the policy's own parameters is
:mod:`bloggap_plugin.core.plans.vllm_shadow` (one module per plan, with the others).
"""
