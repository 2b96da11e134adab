"""The chunked distillation loss against a hand computation over full logits."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from swiftkv_distill.loss import distillation_kl, eval_stats


def reference(student, teacher, weight, rows, temperature):
    log_ps = F.log_softmax(student @ weight.T / temperature, dim=-1)
    log_pt = F.log_softmax(teacher @ weight.detach().T / temperature, dim=-1)  # the teacher is a constant
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    return (kl * rows).sum() * temperature**2, kl


@pytest.mark.parametrize("temperature,chunk", [(2.0, 3), (1.0, 100), (0.5, 1)])
def test_loss_and_gradients_match_hand_computation(temperature, chunk):
    torch.manual_seed(0)
    n, hidden, vocab = 11, 16, 50
    teacher = torch.randn(n, hidden, dtype=torch.float64)
    student = (teacher + 0.3 * torch.randn(n, hidden, dtype=torch.float64)).requires_grad_()
    weight = torch.randn(vocab, hidden, dtype=torch.float64, requires_grad=True)
    rows = torch.rand(n, dtype=torch.float64)

    loss, kl_rows, agree = distillation_kl(
        student, teacher, weight, rows, temperature, chunk, teacher_weight=weight
    )
    loss.backward()
    grad_student, grad_weight = student.grad.clone(), weight.grad.clone()

    student.grad = weight.grad = None
    expected, expected_rows = reference(student, teacher, weight, rows, temperature)
    expected.backward()
    # the kernel computes in fp32
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl_rows.double(), expected_rows.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_student, student.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_weight, weight.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(agree, (student @ weight.T).argmax(-1) == (teacher @ weight.T).argmax(-1))


def test_kl_is_zero_for_identical_inputs_and_frozen_head_gets_no_grad():
    torch.manual_seed(0)
    hidden = torch.randn(5, 8)
    weight = torch.randn(20, 8)  # frozen head
    student = hidden.clone().requires_grad_()
    loss, kl_rows, agree = distillation_kl(student, hidden, weight, torch.ones(5), 2.0, 2)
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and agree.all()
    loss.backward()
    assert student.grad.abs().max() < 1e-6 and weight.grad is None


def test_eval_stats_match_full_logits():
    torch.manual_seed(1)
    student, teacher, weight = torch.randn(7, 8), torch.randn(7, 8), torch.randn(30, 8)
    labels = torch.tensor([3, -100, 5, 0, 29, -100, 7])
    stats = eval_stats(student, teacher, weight, labels, chunk_size=3)
    _, kl = reference(student, teacher, weight, torch.ones(7), 1.0)
    torch.testing.assert_close(stats.kl, kl)
    valid = labels >= 0
    nll = F.cross_entropy(student @ weight.T, labels.clamp(min=0), reduction="none")
    torch.testing.assert_close(stats.student_nll[valid], nll[valid])
    assert torch.isnan(stats.student_nll[~valid]).all()


def test_eval_stats_widen_a_bf16_head_a_block_at_a_time():
    """A bf16 head (``frozen_dtype: bfloat16``) gives the statistics of its fp32 copy, without holding that copy: at
    most a block of it as large as one chunk's logits (the copy is 2.1 GB at 8B), beside those logits."""
    from swiftkv_core.runtime import PeakMemory

    torch.manual_seed(2)
    n, hidden, vocab, chunk = 10, 128, 4096, 4  # blocks of 4 * 4096 / 128 = 128 rows of the head: 32 of them
    student, teacher = torch.randn(n, hidden), torch.randn(n, hidden)
    head = (torch.randn(vocab, hidden) / hidden**0.5).bfloat16()
    labels = torch.randint(0, vocab, (n,))
    with PeakMemory("cpu", resident=[student, teacher, head, labels]) as meter:
        stats = eval_stats(student, teacher, head, labels, chunk_size=chunk)
    expected = eval_stats(student, teacher, head.float(), labels, chunk_size=chunk)  # an fp32 head: no blocks
    for name in ("kl", "agree", "student_nll", "teacher_nll"):
        torch.testing.assert_close(
            getattr(stats, name), getattr(expected, name), rtol=1e-6, atol=1e-7, msg=name
        )
    held, whole_copy, chunk_logits = (
        meter.peak_bytes - meter.resident_bytes,
        vocab * hidden * 4,
        chunk * vocab * 4,
    )
    assert held < 6 * chunk_logits < whole_copy / 4, (held, chunk_logits, whole_copy)


def test_separate_teacher_head():
    """The early-exit head: student logits from its own (trainable) head, teacher logits from the final head."""
    torch.manual_seed(2)
    student, teacher = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8)
    head, final_head = torch.randn(25, 8, requires_grad=True), torch.randn(25, 8)
    loss, _, _ = distillation_kl(student, teacher, head, torch.ones(6), 2.0, 4, teacher_weight=final_head)
    loss.backward()
    grads = student.grad.clone(), head.grad.clone()
    student.grad = head.grad = None
    log_ps = F.log_softmax(student @ head.T / 2, -1)
    log_pt = F.log_softmax(teacher @ final_head.T / 2, -1)
    expected = (log_pt.exp() * (log_pt - log_ps)).sum() * 4
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grads[0], student.grad)
    torch.testing.assert_close(grads[1], head.grad)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_hard_label_term_matches_hand_computation(temperature):
    """hard_weight adds the student's cross-entropy (at T=1) on the teacher's top-1 token, per row weight."""
    torch.manual_seed(3)
    n, hidden, vocab = 9, 12, 40
    teacher = torch.randn(n, hidden, dtype=torch.float64)
    student = (teacher + 0.5 * torch.randn(n, hidden, dtype=torch.float64)).requires_grad_()
    weight, rows = torch.randn(vocab, hidden, dtype=torch.float64), torch.rand(n, dtype=torch.float64)
    loss, _, _ = distillation_kl(student, teacher, weight, rows, temperature, 4, hard_weight=0.7)
    (grad,) = torch.autograd.grad(loss, student)
    kl_sum, _ = reference(student, teacher, weight, rows, temperature)
    ce = F.cross_entropy(student @ weight.T, (teacher @ weight.T).argmax(-1), reduction="none")
    expected = kl_sum + 0.7 * (ce * rows).sum()
    (expected_grad,) = torch.autograd.grad(expected, student)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_under_bf16_autocast_the_head_products_run_in_bf16_close_to_fp32():
    """bf16-mixed training: the LM-head products run in bf16 (the softmaxes and the KL in fp32); the loss, its
    gradient and the agreement stay within bf16 rounding of the fp32 computation."""
    torch.manual_seed(3)
    n, hidden, vocab = 40, 64, 300
    teacher, weight = torch.randn(n, hidden), torch.randn(vocab, hidden) / 8
    student = (teacher + 0.3 * torch.randn(n, hidden)).requires_grad_()
    rows = torch.full((n,), 1.0 / n)
    results = []
    for bf16 in (False, True):
        student.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, kl_rows, agree = distillation_kl(student, teacher, weight, rows, 1.0, 16)
        loss.backward()
        assert loss.dtype == kl_rows.dtype == student.grad.dtype == torch.float32
        results.append((loss.detach(), kl_rows, student.grad.clone(), agree))
    (loss32, kl32, grad32, agree32), (loss16, kl16, grad16, agree16) = results
    assert not torch.equal(kl16, kl32)  # bf16 products did run
    torch.testing.assert_close(loss16, loss32, rtol=0.02, atol=1e-4)
    torch.testing.assert_close(kl16, kl32, rtol=0.05, atol=2e-3)
    torch.testing.assert_close(grad16, grad32, rtol=0.05, atol=2e-4)
    assert (agree16 == agree32).float().mean() >= 0.9


def test_without_autocast_a_bf16_head_runs_its_products_in_bf16_as_under_autocast():
    """bf16-true training (bf16 weights, no autocast): the LM-head products run in bf16, as they do under bf16
    autocast on the same values, not in fp32 on an fp32 copy of the head."""
    torch.manual_seed(6)
    n, hidden, vocab = 24, 64, 300
    teacher, weight = torch.randn(n, hidden).bfloat16(), (torch.randn(vocab, hidden) / 8).bfloat16()
    student = (teacher + 0.3 * torch.randn(n, hidden)).bfloat16()
    rows = torch.full((n,), 1.0 / n)
    results = []
    for true_bf16 in (True, False):  # bf16 tensors, no autocast; their values in fp32 under bf16 autocast
        x = (student if true_bf16 else student.float()).clone().requires_grad_()
        dtype = torch.bfloat16 if true_bf16 else torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not true_bf16):
            loss, kl_rows, agree = distillation_kl(x, teacher.to(dtype), weight.to(dtype), rows, 2.0, 16)
        loss.backward()
        assert x.grad.dtype == dtype
        results.append((loss.detach(), kl_rows, x.grad, agree))
    (loss_true, kl_true, grad_true, agree_true), (loss_mixed, kl_mixed, grad_mixed, agree_mixed) = results
    assert torch.equal(loss_true, loss_mixed) and torch.equal(kl_true, kl_mixed)
    assert torch.equal(agree_true, agree_mixed) and torch.equal(grad_true, grad_mixed.bfloat16())


def test_compiled_kl_chunk_equals_the_eager_one():
    import torch._inductor.compile_fx  # noqa: F401  (imported here: its own deprecation warnings are not the KL's)

    from swiftkv_distill import loss

    torch.manual_seed(4)
    for dtype, temperature in ((torch.float32, 1.0), (torch.bfloat16, 2.0)):
        t_logits, s_logits = (3 * torch.randn(7, 500)).to(dtype), (3 * torch.randn(7, 500)).to(dtype)
        w = torch.rand(7)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a compiler failure would compare the eager function with itself
            compiled = loss._kl_chunk(t_logits, s_logits, w, temperature)
        assert loss._compiled_kl_chunk is not loss._kl_chunk_eager
        eager = loss._kl_chunk_eager(t_logits, s_logits, w, temperature)
        assert compiled[1].dtype == dtype
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled[1].float(), eager[1].float(), rtol=1e-2, atol=1e-6)
        assert torch.equal(compiled[2], eager[2])


def test_a_failing_compiler_falls_back_to_the_eager_kl_with_one_warning(monkeypatch, tmp_path):
    """torch.compile failing for real: inductor pointed at a C++ compiler that is not there, with nothing cached."""
    import torch._dynamo
    import torch._inductor.config

    from swiftkv_distill import loss

    monkeypatch.setattr(loss, "_compiled_kl_chunk", None)  # compiled again at the first call
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    torch.manual_seed(5)
    args = (torch.randn(4, 30), torch.randn(4, 30), torch.rand(4), 1.0)
    # inductor's own patch: pytest's monkeypatch would delete these settings on undo (a config module's attributes)
    no_compiler = torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False})
    before = torch._inductor.config.fx_graph_cache, torch._inductor.config.cpp.cxx
    try:
        with (
            no_compiler,
            pytest.warns(UserWarning, match="uncompiled: torch.compile failed .*C\\+\\+ compiler"),
        ):
            first = loss._kl_chunk(*args)
    finally:
        torch._dynamo.reset()  # nothing of this compile kept for the tests after it
    assert (torch._inductor.config.fx_graph_cache, torch._inductor.config.cpp.cxx) == before  # restored
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        second = loss._kl_chunk(*args)
    for a, b, c in zip(first, second, loss._kl_chunk_eager(*args), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_running_out_of_device_memory_is_not_taken_for_a_compiler_failure(monkeypatch):
    """A CUDA out-of-memory error inside the compiled KL reaches the caller (Lightning, the quickstart's advice),
    and the KL stays compiled: it is not a compiler failure, and the eager function would run out too. (A CPU
    cannot run out of CUDA memory: the error is raised by a stand-in.)"""
    from swiftkv_distill import loss

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(loss, "_compiled_kl_chunk", out_of_memory)
    args = (torch.randn(4, 30), torch.randn(4, 30), torch.rand(4), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
            loss._kl_chunk(*args)
    assert loss._compiled_kl_chunk is out_of_memory
