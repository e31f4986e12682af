"""What the first call costs: trace and lower, XLA compile, the optimised HLO
instruction count and the run time of the programs a user runs first, each beside an
anchor doing the same job.

Each program runs in a fresh Python process (the script calls itself, `--one NAME`,
and reads one JSON line back), so nothing is cached: inputs are built, JAX's caches
cleared (`jax.clear_caches()`), then `eqx.filter_jit(fn).lower(*args)` (trace and
lower, timed), `.compile()` (XLA, timed), the instructions of the optimised HLO
counted (`compiled.as_text()`, as `program_cost.py` counts them), and the compiled
program timed (`_timing.measure_many`: medians after a warm-up, with
`jax.block_until_ready`). Default XLA flags (whatever `XLA_FLAGS` the run inherits
is recorded); float64 (`jax_enable_x64`) for the Kalman and nonlinear programs,
float32 for the layers, float64 for the tridiagonal solve; one CPU device, two for
the split program (`jax_num_cpu_devices`). With `--rounds R` every program runs in
R fresh processes (default 3; 1 with `--quick`), round-robin, and the times are
medians over the rounds.

The pairs (ours | anchor), called the way `docs/` calls them; the anchors are the
other scripts' (imported from them):

1. `KalmanFilter(4, 2)`, T = 1000: `eqx.filter_grad` of `log_likelihood` | dynamax's
   `lgssm_filter(...).marginal_loglik`, `jax.grad` w.r.t. its params
   (`bench_kalman.dynamax_params`);
2. the smoothed means, `smooth(ys).means` | dynamax's `lgssm_smoother`;
3. the log-likelihood's value and gradient split over 2 CPU devices
   (`ShardedScan("time")` in `jax.shard_map`, the recipe of
   `docs/usage/several-devices.md`) | ours on one device (row 1);
4.-6. `NonlinearKalmanFilter` on `bench_nonlinear`'s pendulum, T = 1000: the
   log-likelihood's gradient, unscented and extended | dynamax's
   `unscented_kalman_filter` / `extended_kalman_filter` (gradient w.r.t. g, Q, R and
   the prior, as `bench_nonlinear` takes it); the gradient of the iterated extended
   smoother's (IEKS) mean square of the smoothed means | the one-pass extended
   smoother's;
7. `Mamba(64, state_size=16)`, T = 1024, gradient of the mean square of the output
   w.r.t. the layer | the same layer with its selective scan replaced (in the
   anchor's process) by a plain `lax.scan` S6 (`plain_s6_scan` below), and by
   `bench_selective.plain_s6` (`lax.associative_scan`, as the JAX ports write it);
8. `Mamba2(64, state_size=16, head_dim=64)` | the same layer with `ssd_scan`
   replaced by the paper's minimal SSD (`bench_ssd.minimal_ssd`);
9. `S5(64, 64, blocks=4)` | `bench_s5.plain_s5` on the layer's parameters;
10. `ssd_scan` (H = 2, P = 64, N = 16, chunks of 64), gradient w.r.t. x, dt, B, C
    | the minimal SSD (`bench_ssd`'s setting);
11. `RGLRU(64, num_heads=4)` | `bench_selective.plain_rglru` (`lax.scan`);
    `HawkBlock(64, num_heads=4)` | the same block with its RG-LRU replaced by the
    plain one;
12. ours alone: `fit_em` (one iteration), `forecast` (100 steps), `posterior_sample`
    (100 paths) of row 1's filter, a `SequenceClassifier` training step (the docs'
    `s5_optimizer` step, 8 sequences), `LanguageModel.generate` (100 tokens); and
    `tridiagonal_solve`'s gradient (64 systems of 1000) | that of
    `jax.lax.linalg.tridiagonal_solve` (`bench_tridiagonal.lax_gtsv`).

The goals (the issue's): XLA compile time over the anchor's at most 1.5x for the
Kalman log-likelihood gradient, EKF, UKF and the Mamba, Mamba2, S5 and `ssd_scan`
gradients, 2x for the smoother, the split program (over one device) and the IEKS
(over the one-pass smoother); and no one-device program of ours above 6 s from
trace to compiled (lower + compile), no split one above 12 s. "check" compares a
value both programs of a pair compute (the log-likelihood, the loss, the smoothed
means' sum) where they compute the same.

    python benchmarks/bench_compile.py             # about 25 minutes on 2 CPU cores
    python benchmarks/bench_compile.py --rounds 1  # one process per program: a third
    python benchmarks/bench_compile.py --quick     # T = 50 / 128, a few rows
    python benchmarks/bench_compile.py --only mamba,ssd --json /tmp/c.json
"""

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import eqx_seq


sys.path.insert(0, os.path.dirname(__file__))
import bench_kalman  # noqa: E402
from _timing import (  # noqa: E402
    allocator_line,
    DASH,
    div,
    hlo_instructions,
    machine,
    measure_many,
    ms,
    results_path,
    save,
    table,
    times,
    write_reports,
)
from bench_s5 import layer_params, plain_s5  # noqa: E402
from bench_selective import plain_rglru, plain_s6, rglru_params  # noqa: E402


# bench_nonlinear, bench_ssd and bench_tridiagonal set JAX options on import (x64,
# CPU devices): imported in the programs' processes only (`one`)


# --- the anchors written here (the others are the sibling scripts') ---------------
def plain_s6_scan(u, delta, A, B, C, D, z, delta_bias):
    """`bench_selective.plain_s6` with `lax.scan` over time: the state `(D, N)`
    carried, `exp(Δ A)` and `(Δ u) B` formed per step, autodiff through the loop.
    Returns the outputs and the last state."""
    delta = jax.nn.softplus(delta + delta_bias)

    def step(h, inputs):
        u_t, d_t, B_t, C_t = inputs
        h = jnp.exp(d_t[:, None] * A) * h + (d_t * u_t)[:, None] * B_t[None]
        return h, h @ C_t

    h0 = jnp.zeros(A.shape, u.dtype)
    h, y = jax.lax.scan(step, h0, (u, delta, B, C))
    return (y + D * u) * jax.nn.silu(z), h


def selective_scan_of(core):
    """A stand-in for `eqx_seq.selective_scan` as `Mamba` calls it (no initial
    state, no resets), computed by a plain `core`."""

    def selective_scan(u, delta, A, B, C, D, *, z, delta_bias, delta_softplus,
                       h0=None, reset=None, return_last_state=False,
                       negative_decays=False, scan=None, chunk_size=None):  # fmt: skip
        assert delta_softplus and h0 is None and reset is None
        assert not negative_decays
        out = core(u, delta, A, B, C, D, z, delta_bias)
        y, h = out if isinstance(out, tuple) else (out, jnp.zeros(A.shape, u.dtype))
        return (y, h) if return_last_state else y

    return selective_scan


def minimal_ssd_scan(x, dt, A, B, C, D=None, *, z=None, dt_bias=None,
                     dt_softplus=False, dt_limit=(0.0, float("inf")),
                     negative_decays=False, h0=None, reset=None,
                     return_final_state=False, chunk_size=64, scan=None):  # fmt: skip
    """A stand-in for `eqx_seq.ssd_scan` as `Mamba2` calls it (one group, no initial
    state, no resets), computed by the paper's minimal SSD (`bench_ssd`)."""
    from bench_ssd import minimal_ssd

    assert z is None and h0 is None and reset is None and not negative_decays
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    dt = jnp.clip(dt, *dt_limit)
    y = minimal_ssd(x, dt, A, B, C, chunk_size)
    if D is not None:
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    if return_final_state:  # not used by the layer's output
        return y, jnp.zeros((x.shape[1], x.shape[2], B.shape[-1]), x.dtype)
    return y


# --- the programs: name -> builder(sizes) -> (fn, args, value) ----------------------
# `value(out)` gives a number both programs of a pair compute (or None), for the
# check; it runs after the measurements.
SIZES = {"full": {"T": 1000, "L": 1024}, "quick": {"T": 50, "L": 128}}
WIDTH, STATE = 64, 16


def _mean_square(y):
    return jnp.mean(y**2)


def _kalman(s, **kw):
    kf = eqx_seq.KalmanFilter(4, 2, key=jr.key(0), **kw)
    return kf, kf.sample(jr.key(1), s["T"])[1]


def p_kalman_grad(s):
    kf, ys = _kalman(s)
    ll = lambda kf, ys: kf.log_likelihood(ys)
    return eqx.filter_grad(ll), (kf, ys), lambda out: ll(kf, ys)


def _dynamax_lgssm(s):
    bench_kalman._load_dynamax()
    if bench_kalman.lgssm_filter is None:
        raise SystemExit("dynamax is not installed")
    kf, ys = _kalman(s)
    return bench_kalman, bench_kalman.dynamax_params(kf), ys


def p_dynamax_grad(s):
    bk, params, ys = _dynamax_lgssm(s)
    ll = lambda params, ys: bk.lgssm_filter(params, ys).marginal_loglik
    return jax.grad(ll), (params, ys), lambda out: ll(params, ys)


def p_kalman_smooth(s):
    kf, ys = _kalman(s)
    return (lambda kf, ys: kf.smooth(ys).means), (kf, ys), lambda out: out.sum()


def p_dynamax_smooth(s):
    bk, params, ys = _dynamax_lgssm(s)
    fn = lambda params, ys: bk.lgssm_smoother(params, ys).smoothed_means
    return fn, (params, ys), lambda out: out.sum()


def p_kalman_split(s):
    """docs/usage/several-devices.md, "The Kalman filter split over time"."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("time",))
    kf, ys = _kalman(s, scan=eqx_seq.ShardedScan("time"))
    params, static = eqx.partition(kf, eqx.is_inexact_array)
    specs = jax.tree.map(lambda x: P("time") if x.ndim == 3 else P(), params)

    def log_likelihood(params, ys):
        return eqx.combine(params, static).log_likelihood(ys)

    ll = jax.shard_map(
        log_likelihood, mesh=mesh, in_specs=(specs, P("time")), out_specs=P()
    )
    return jax.value_and_grad(ll), (params, ys), lambda out: out[0]


def p_fit_em(s):
    kf, ys = _kalman(s)
    fn = lambda kf, ys: kf.fit_em(ys, num_iters=1)
    return fn, (kf, ys), lambda out: out[1][-1]


def p_forecast(s):
    kf, ys = _kalman(s)
    return (lambda kf, ys: kf.forecast(ys, 100)), (kf, ys), None


def p_posterior_sample(s):
    kf, ys = _kalman(s)
    fn = lambda kf, key, ys: kf.posterior_sample(key, ys, 100)
    return fn, (kf, jr.key(2), ys), None


def _pendulum(s):
    import bench_nonlinear as bn

    return bn, bn.model(jnp.float64), bn.draw(s["T"], jnp.float64)


def _nonlinear_grad(method):
    def build(s):
        _, model, ys = _pendulum(s)
        ll = lambda m, ys: m.log_likelihood(ys, method=method)
        return eqx.filter_grad(ll), (model, ys), lambda out: ll(model, ys)

    return build


def _dynamax_nonlinear_grad(key):
    def build(s):
        bn, _, ys = _pendulum(s)
        dx = bn._dynamax()
        if dx is None:
            raise SystemExit("dynamax is not installed")
        extra = (dx["ukf_hyper"](),) if key == "ukf" else ()

        def ll(theta, ys):
            return dx[key](bn.dynamax_params(dx, theta), ys, *extra).marginal_loglik

        theta = bn.theta_of(jnp.float64)
        return jax.grad(ll), (theta, ys), lambda out: ll(theta, ys)

    return build


def _smoother_grad(iterated):
    def build(s):
        _, model, ys = _pendulum(s)

        def loss(m, ys):
            out = m.smooth(ys, method="extended", iterated=iterated)
            return _mean_square(out.means)

        return eqx.filter_grad(loss), (model, ys), None

    return build


def _layer_grad(make, patch=None):
    """`eqx.filter_grad` of the mean square of the layer's output, w.r.t. the
    layer; `patch()` first replaces the layer's core (the anchor's process only)."""

    def build(s):
        if patch is not None:
            patch()
        layer = make(jr.key(0))
        x = jr.normal(jr.key(1), (s["L"], WIDTH), layer_dtype(layer))
        loss = lambda layer, x: _mean_square(layer(x))
        return eqx.filter_grad(loss), (layer, x), lambda out: loss(layer, x)

    return build


def layer_dtype(layer):
    return jax.tree.leaves(eqx.filter(layer, eqx.is_inexact_array))[0].dtype


def _mamba(key):
    return eqx_seq.Mamba(WIDTH, state_size=STATE, key=key)


def _mamba2(key):
    return eqx_seq.Mamba2(WIDTH, state_size=STATE, head_dim=64, key=key)


def _hawk(key):
    return eqx_seq.HawkBlock(WIDTH, num_heads=4, key=key)


def _patch_mamba(core):
    def patch():
        import eqx_seq._ssm._mamba as module

        module.selective_scan = selective_scan_of(core)

    return patch


def _patch_mamba2():
    import eqx_seq._ssm._mamba2 as module

    module.ssd_scan = minimal_ssd_scan


def _patch_hawk():
    """The RG-LRU inside `HawkBlock` computed by `bench_selective.plain_rglru`."""
    import eqx_seq._ssm._rglru as module

    def call(self, x, *, reset=None, h0=None, key=None):
        assert reset is None and h0 is None
        return plain_rglru(rglru_params(self), x)

    module.RGLRU.__call__ = call


def p_mamba_plain_assoc(s):
    return _layer_grad(_mamba, _patch_mamba(plain_s6))(s)


def p_s5(s):
    make = lambda key: eqx_seq.S5(WIDTH, 64, blocks=4, key=key)
    return _layer_grad(make)(s)


def p_plain_s5(s):
    params = layer_params(eqx_seq.S5(WIDTH, 64, blocks=4, key=jr.key(0)))
    x = jr.normal(jr.key(1), (s["L"], WIDTH), params[-1].dtype)
    loss = lambda params, x: _mean_square(plain_s5(params, x)[0])
    return jax.grad(loss), (params, x), lambda out: loss(params, x)


def p_rglru(s):
    return _layer_grad(lambda key: eqx_seq.RGLRU(WIDTH, num_heads=4, key=key))(s)


def p_plain_rglru(s):
    layer = eqx_seq.RGLRU(WIDTH, num_heads=4, key=jr.key(0))
    params = rglru_params(layer)
    x = jr.normal(jr.key(1), (s["L"], WIDTH), params[0].dtype)
    loss = lambda params, x: _mean_square(plain_rglru(params, x))
    return jax.grad(loss), (params, x), lambda out: loss(params, x)


def _ssd(ours):
    def build(s):
        from bench_ssd import minimal_ssd, scan_inputs

        x, dt, A, B, C = scan_inputs(s["L"], 2, 64, STATE, jr.key(0))
        if ours:
            f = lambda x, dt, B, C: eqx_seq.ssd_scan(x, dt, A, B, C, chunk_size=64)
        else:
            f = lambda x, dt, B, C: minimal_ssd(x, dt, A, B, C, 64)
        loss = lambda *a: _mean_square(f(*a))
        return jax.grad(loss, range(4)), (x, dt, B, C), lambda out: loss(x, dt, B, C)

    return build


def _tridiagonal(ours):
    def build(s):
        from bench_tridiagonal import lax_gtsv, make_data

        data = make_data(64, s["T"], np.float64)  # (systems, n)
        if ours:  # the docs' layout: the systems' rows along axis 0
            solve = eqx_seq.tridiagonal_solve
            data = tuple(np.ascontiguousarray(x.T) for x in data)
        else:
            solve = lax_gtsv
        data = tuple(jnp.asarray(x) for x in data)
        loss = lambda *a: jnp.sum(solve(*a) ** 2)
        return jax.grad(loss, range(4)), data, lambda out: loss(*data)

    return build


def p_classifier_step(s):
    """The training step of docs/usage/embedding-and-models.md."""
    import optax

    model = eqx_seq.SequenceClassifier(
        1, 10, width=16, depth=1, state_size=16, key=jr.key(0)
    )
    optim = eqx_seq.s5_optimizer(4e-3, ssm_learning_rate=2e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    def train_step(model, opt_state, x, labels):
        def loss(model):
            logits = jax.vmap(model)(x)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, labels
            ).mean()

        value, grads = eqx.filter_value_and_grad(loss)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, value

    x = jr.normal(jr.key(1), (8, s["L"], 1))
    labels = jr.randint(jr.key(2), (8,), 0, 10)
    return train_step, (model, opt_state, x, labels), lambda out: out[2]


def p_generate(s):
    lm = eqx_seq.LanguageModel(50, width=32, depth=2, state_size=16, key=jr.key(0))
    prompt = jnp.arange(16) % 50
    fn = lambda lm, prompt, key: lm.generate(prompt, 100, key=key, temperature=0.8)
    return fn, (lm, prompt, jr.key(1)), None


# name -> (builder, float64?, CPU devices, what it is)
PROGRAMS = {
    "kalman_grad": (p_kalman_grad, True, 1, "`KalmanFilter` log-likelihood gradient"),
    "dynamax_grad": (p_dynamax_grad, True, 1, "dynamax `lgssm_filter` gradient"),
    "kalman_smooth": (p_kalman_smooth, True, 1, "`KalmanFilter.smooth` means"),
    "dynamax_smooth": (p_dynamax_smooth, True, 1, "dynamax `lgssm_smoother`"),
    "kalman_split": (
        p_kalman_split, True, 2, "`KalmanFilter` log-likelihood + gradient on 2 devices"
    ),
    "ukf_grad": (_nonlinear_grad("unscented"), True, 1, "UKF log-likelihood gradient"),
    "dynamax_ukf_grad": (
        _dynamax_nonlinear_grad("ukf"), True, 1, "dynamax `unscented_kalman_filter`"
    ),
    "ekf_grad": (_nonlinear_grad("extended"), True, 1, "EKF log-likelihood gradient"),
    "dynamax_ekf_grad": (
        _dynamax_nonlinear_grad("ekf"), True, 1, "dynamax `extended_kalman_filter`"
    ),
    "ieks_grad": (_smoother_grad(True), True, 1, "IEKS gradient"),
    "eks_grad": (_smoother_grad(False), True, 1, "one-pass extended smoother"),
    "mamba": (_layer_grad(_mamba), False, 1, "`Mamba` gradient"),
    "mamba_plain_scan": (
        _layer_grad(_mamba, _patch_mamba(plain_s6_scan)), False, 1,
        "`Mamba`, `lax.scan` S6",
    ),
    "mamba_plain_assoc": (
        p_mamba_plain_assoc, False, 1, "`Mamba`, plain S6 (`associative_scan`)"
    ),
    "mamba2": (_layer_grad(_mamba2), False, 1, "`Mamba2` gradient"),
    "mamba2_minimal": (
        _layer_grad(_mamba2, _patch_mamba2), False, 1, "`Mamba2`, minimal SSD"
    ),
    "s5": (p_s5, False, 1, "`S5` gradient"),
    "plain_s5": (p_plain_s5, False, 1, "plain S5"),
    "ssd": (_ssd(True), False, 1, "`ssd_scan` gradient"),
    "minimal_ssd": (_ssd(False), False, 1, "minimal SSD"),
    "rglru": (p_rglru, False, 1, "`RGLRU` gradient"),
    "plain_rglru": (p_plain_rglru, False, 1, "plain RG-LRU (`lax.scan`)"),
    "hawk": (_layer_grad(_hawk), False, 1, "`HawkBlock` gradient"),
    "hawk_plain": (
        _layer_grad(_hawk, _patch_hawk), False, 1, "`HawkBlock`, plain RG-LRU"
    ),
    "fit_em": (p_fit_em, True, 1, "`KalmanFilter.fit_em`, 1 iteration"),
    "forecast": (p_forecast, True, 1, "`KalmanFilter.forecast`, 100 steps"),
    "posterior_sample": (
        p_posterior_sample, True, 1, "`KalmanFilter.posterior_sample`, 100 paths"
    ),
    "tridiagonal": (_tridiagonal(True), True, 1, "`tridiagonal_solve` gradient"),
    "gtsv": (_tridiagonal(False), True, 1, "`lax.linalg.tridiagonal_solve` gradient"),
    "classifier_step": (
        p_classifier_step, False, 1, "`SequenceClassifier` training step"
    ),
    "generate": (p_generate, False, 1, "`LanguageModel.generate`, 100 tokens"),
}  # fmt: skip

# (ours, anchor or None, the goal on the compile ratio or None)
ROWS = (
    ("kalman_grad", "dynamax_grad", 1.5),
    ("kalman_smooth", "dynamax_smooth", 2.0),
    ("kalman_split", "kalman_grad", 2.0),
    ("ukf_grad", "dynamax_ukf_grad", 1.5),
    ("ekf_grad", "dynamax_ekf_grad", 1.5),
    ("ieks_grad", "eks_grad", 2.0),
    ("mamba", "mamba_plain_scan", 1.5),
    ("mamba", "mamba_plain_assoc", None),
    ("mamba2", "mamba2_minimal", 1.5),
    ("s5", "plain_s5", 1.5),
    ("ssd", "minimal_ssd", 1.5),
    ("rglru", "plain_rglru", None),
    ("hawk", "hawk_plain", None),
    ("tridiagonal", "gtsv", None),
    ("fit_em", None, None),
    ("forecast", None, None),
    ("posterior_sample", None, None),
    ("classifier_step", None, None),
    ("generate", None, None),
)
# the rows of --quick: (ours, anchor)
QUICK = (
    ("kalman_grad", "dynamax_grad"),
    ("kalman_split", "kalman_grad"),
    ("mamba", "mamba_plain_scan"),
    ("forecast", None),
)
# the absolute goal: trace to compiled, seconds, by the number of devices
LIMIT_S = {1: 6.0, 2: 12.0}
SIBLINGS = ("bench_nonlinear", "bench_ssd", "bench_tridiagonal")


# --- one program, in its own process ------------------------------------------------
def one(name: str, quick: bool, repeats: int) -> dict:
    build, x64, devices, _ = PROGRAMS[name]
    default_devices = jax.config.jax_num_cpu_devices
    # the sibling scripts set JAX options on import (x64, CPU devices): import them
    # all, then set this program's, before JAX starts its backend
    for module in SIBLINGS:
        importlib.import_module(module)
    jax.config.update("jax_enable_x64", x64)
    jax.config.update(
        "jax_num_cpu_devices", devices if devices > 1 else default_devices
    )
    fn, args, value = build(SIZES["quick" if quick else "full"])
    jax.clear_caches()  # nothing traced or compiled while building the inputs
    jitted = eqx.filter_jit(fn)
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = getattr(compiled, "compiled", compiled).as_text()
    run = measure_many({name: (compiled, args)}, repeats=repeats, min_time=0.05)
    out = compiled(*args)
    return {
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "hlo_instructions": hlo_instructions(text),
        "run_ms": run[name]["median_ms"],
        "value": None if value is None else float(value(out)),
        "dtype": "float64" if x64 else "float32",
        "devices": len(jax.devices()),
    }


def in_process(name: str, quick: bool, repeats: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--one", name, "--repeats", str(repeats)]
    cmd += ["--quick"] * quick
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"status": f"failed: {last[:200]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def combine(rounds: list) -> dict:
    """Medians over the fresh processes of one program."""
    ok = [r for r in rounds if "status" not in r]
    if not ok:
        return {"status": rounds[0]["status"], "rounds": rounds}
    res = dict(ok[0])
    for k in ("lower_s", "compile_s", "run_ms"):
        res[k] = statistics.median(o[k] for o in ok)
    return {**res, "rounds": rounds}


# --- the report -------------------------------------------------------------------
def _first_call(r):
    return r["lower_s"] + r["compile_s"]


def row_goal(p, ours, anchor, goal):
    """(goal text, met text, compile ratio) of one row."""
    o = p["programs"][ours]
    a = p["programs"].get(anchor) if anchor else None
    limit = _limit(p, ours)
    text = [f"≤{limit:g} s"]
    missed = []
    ratio = None
    if "status" in o:
        return " ".join(text), "failed", None
    if a is not None and "status" not in a:
        ratio = o["compile_s"] / a["compile_s"]
    if goal is not None:
        text.insert(0, f"≤{goal:g}×")
        if ratio is None:
            missed.append("no anchor")
        elif ratio > goal:
            missed.append("ratio")
    if _first_call(o) > limit:
        missed.append(f"{limit:g} s")
    return (
        ", ".join(text),
        "missed (" + ", ".join(missed) + ")" if missed else "met",
        ratio,
    )


def _limit(p, name):
    return p["limits_s"][str(p["programs"][name].get("devices", 1))]


def _label(p, name):
    return p["labels"][name]


def _rows(p):
    return [r for r in p["rows"] if r[0] in p["programs"]]


def _check(p, ours, anchor):
    o, a = p["programs"][ours], p["programs"].get(anchor or "", {})
    if o.get("value") is None or a.get("value") is None:
        return DASH
    rel = abs(o["value"] - a["value"]) / max(abs(a["value"]), 1e-300)
    return f"{rel:.0e}"


def tables(p):
    out = [
        f"Each program in a fresh process ({p['rounds']} per program, medians), "
        f"{p['sizes']['T']} steps for the Kalman, nonlinear and tridiagonal programs "
        f"(float64), {p['sizes']['L']} for the layers (float32, width {WIDTH}); "
        '"lower s": trace and lower (`filter_jit(fn).lower`), "compile s": XLA '
        "(`.compile()`), HLO: instructions of the optimised module, run: median ms "
        'after warm-up; ratios: ours over the anchor. "goal": compile ratio and '
        "our lower + compile time (≤6 s on one device, ≤12 s split).",
        "",
    ]
    rows, checks = [], []
    for ours, anchor, goal in _rows(p):
        o = p["programs"][ours]
        a = p["programs"].get(anchor) if anchor else None
        name = _label(p, ours)
        goal_text, met, ratio = row_goal(p, ours, anchor, goal)
        if "status" in o:
            cells = [o["status"], DASH, DASH, DASH]
        else:
            cells = [
                f"{o['lower_s']:.2f}",
                f"{o['compile_s']:.2f}",
                o["hlo_instructions"],
                ms(o["run_ms"]),
            ]
        if anchor is None:
            cells += [DASH] * 8
        elif "status" in a:
            cells += [_label(p, anchor) + ": " + a["status"]] + [DASH] * 7
        else:
            both = "status" not in o
            cells += [
                _label(p, anchor),
                f"{a['lower_s']:.2f}",
                f"{a['compile_s']:.2f}",
                a["hlo_instructions"],
                ms(a["run_ms"]),
                times(ratio),
                times(div(o["hlo_instructions"], a["hlo_instructions"]))
                if both
                else DASH,
                times(div(o["run_ms"], a["run_ms"])) if both else DASH,
            ]
        rows.append([name] + cells + [goal_text, met])
        if "status" not in o:
            a_ok = a is not None and "status" not in a
            checks.append(
                [
                    name,
                    f"{_first_call(o):.2f}",
                    f"{_first_call(a):.2f}" if a_ok else DASH,
                    times(div(_first_call(o), _first_call(a))) if a_ok else DASH,
                    _check(p, ours, anchor),
                ]
            )
    lines = table(
        "program | ours lower s | ours compile s | ours HLO | ours run ms | anchor | "
        "anchor lower s | anchor compile s | anchor HLO | anchor run ms | "
        "compile ratio | HLO ratio | run ratio | goal | met",
        rows,
    )
    # the names (program, anchor, goal, met) left-aligned, the numbers right
    lines[1] = (
        "|"
        + "|".join(":---" if i in (0, 5, 13, 14) else "---:" for i in range(15))
        + "|"
    )
    out += lines
    out += [
        "Lower + compile (the first call's wait before running), and the check: "
        "the relative difference of a value both programs compute (log-likelihood, "
        "loss or the smoothed means' sum; – where they compute different things):",
        "",
    ]
    out += table(
        "program | ours lower + compile s | anchor lower + compile s | ratio | check",
        checks,
    )
    return out


def headline(p):
    rows = _rows(p)
    goals = [r for r in rows if r[2] is not None]
    missed = [r for r in goals if row_goal(p, *r)[1] != "met"]
    line = f"compile-ratio goals met in {len(goals) - len(missed)} of {len(goals)} rows"
    if missed:
        line += " (missed: " + ", ".join(_label(p, r[0]) for r in missed) + ")"
    firsts = {}
    for name in dict.fromkeys(r[0] for r in rows):  # ours, in the rows' order
        if "status" not in p["programs"][name]:
            firsts[name] = _first_call(p["programs"][name])
    slow = [n for n, s in firsts.items() if s > _limit(p, n)]
    line += "; " + (
        "every program of ours within its time limit"
        if not slow
        else "over the time limit: "
        + ", ".join(f"{_label(p, n)} {firsts[n]:.1f} s" for n in slow)
    )
    worst = max(firsts, key=firsts.get)
    return line + f"; slowest first call: {_label(p, worst)}, {firsts[worst]:.1f} s"


REPORTS = {"compile": (headline, tables)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T = 50 / 128, few rows")
    parser.add_argument("--repeats", type=int, default=5, help="run-time samples")
    parser.add_argument(
        "--rounds", type=int, help="fresh processes per program (3; --quick: 1)"
    )
    parser.add_argument(
        "--only", help="comma-separated programs or rows (by either program's name)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="per process, s")
    parser.add_argument("--json", help="default: results/<machine>/compile.json")
    parser.add_argument(
        "--report", nargs="+", metavar="JSON", help="write the .md of stored results"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        write_reports(REPORTS, args.report)
        return
    if args.one:
        print(json.dumps(one(args.one, args.quick, args.repeats)))
        return
    rounds = args.rounds or (1 if args.quick else 3)
    rows = [r for r in ROWS if not args.quick or r[:2] in QUICK]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - set(PROGRAMS)
        if unknown:
            parser.error(f"unknown programs {sorted(unknown)}; known: {list(PROGRAMS)}")
        rows = [r for r in rows if wanted & {r[0], r[1]}]
    names = list(dict.fromkeys(n for r in rows for n in r[:2] if n is not None))
    info = machine()
    print(
        f"machine: {info['cpu']} ({info['cores']} cores), {info['platform']}, "
        f"jax {info['jax']}; XLA_FLAGS={info['xla_flags'] or '(default)'}"
    )
    print(allocator_line(info))
    results = {name: [] for name in names}
    for r in range(rounds):
        for name in names:
            res = in_process(name, args.quick, args.repeats, args.timeout)
            results[name].append(res)
            said = res.get("status") or (
                f"lower {res['lower_s']:.2f} s, compile {res['compile_s']:.2f} s, "
                f"{res['hlo_instructions']} instructions, run {ms(res['run_ms'])} ms"
            )
            print(f"round {r + 1}, {name}: {said}", flush=True)
    payload = {
        "machine": info,
        "rounds": rounds,
        "sizes": SIZES["quick" if args.quick else "full"],
        "rows": rows,
        "labels": {name: PROGRAMS[name][3] for name in names},
        "limits_s": {str(k): v for k, v in LIMIT_S.items()},
        "programs": {name: combine(rs) for name, rs in results.items()},
    }
    save(args.json or results_path("compile"), payload, REPORTS["compile"])


if __name__ == "__main__":
    main()
