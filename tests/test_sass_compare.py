"""tools/sass_compare.py's kernel keys and its base-to-working-tree renaming for a template
parameter added (--added-arg) or removed (--removed-arg). CPU only: no nvcc, no cubins; the
mangled names are nvcc's for csrc/'s FP8 kernel with and without a third template argument."""

from tools.sass_compare import kernel_key, label, rekey

PARAMS = "Ev14CUtensorMap_stS2_S2_S2_NS0_12KernelParamsE"
WITH_THIRD = "_ZN7megamoe3fp815fp8_gemm_kernelILi1ELb0ELi2EE" + PARAMS
TWO_ARGS = "_ZN7megamoe3fp815fp8_gemm_kernelILi1ELb1EE" + PARAMS
BF16 = "_ZN7megamoe4bf1619grouped_gemm_kernelILi2EE" + PARAMS.replace("S2_S2_S2_", "S2_S2_S2_S2_")


def test_kernel_key_takes_every_integer_and_bool_argument_without_namespaces():
    assert kernel_key(WITH_THIRD) == ("fp8_gemm_kernel", "1,0,2")
    assert kernel_key(TWO_ARGS) == ("fp8_gemm_kernel", "1,1")
    assert kernel_key(BF16) == ("grouped_gemm_kernel", "2")
    assert kernel_key("plain_kernel") == ("plain_kernel", "")
    assert label(kernel_key(TWO_ARGS)) == "fp8 gemm1_swiglu <1>"


def _base():
    return {("fp8_gemm_kernel", "1,0,1"): "g1", ("fp8_gemm_kernel", "1,0,2"): "g1 pairs",
            ("fp8_gemm_kernel", "0,0,1"): "rows", ("grouped_gemm_kernel", "1"): "bf16"}


def test_removed_arg_keeps_the_instances_with_its_value_under_the_shorter_key():
    old, gone = rekey(_base(), removed="fp8_gemm_kernel=1")
    assert old == {("fp8_gemm_kernel", "1,0"): "g1", ("fp8_gemm_kernel", "0,0"): "rows",
                   ("grouped_gemm_kernel", "1"): "bf16"}
    assert gone == [("fp8_gemm_kernel", "1,0,2")]


def test_added_arg_appends_the_value_and_nothing_is_gone():
    base = {("fp8_gemm_kernel", "1,0"): "g1", ("grouped_gemm_kernel", "1"): "bf16"}
    old, gone = rekey(base, added="fp8_gemm_kernel=1")
    assert old == {("fp8_gemm_kernel", "1,0,1"): "g1", ("grouped_gemm_kernel", "1"): "bf16"}
    assert gone == []


def test_added_then_removed_is_the_identity_on_the_kept_instances():
    base = {("fp8_gemm_kernel", "1,0"): "g1", ("grouped_gemm_kernel", "1"): "bf16"}
    grown, _ = rekey(base, added="fp8_gemm_kernel=1")
    assert rekey(grown, removed="fp8_gemm_kernel=1") == (base, [])
    assert rekey(base) == (base, [])
