"""Optimiser labels for the S5 recipe: SSM parameters get their own learning rate."""

import equinox as eqx
import jax
import optax
from jaxtyping import ArrayLike, PyTree, Real

from .._misc import check_real
from ._recurrent import AbstractRecurrentLayer


def _is_layer(x: object) -> bool:
    return isinstance(x, AbstractRecurrentLayer)


def _recurrence_parameters(tree: PyTree) -> list:
    """The `recurrence_fields` of every recurrent layer in `tree`, those nested in
    another (a block's layer) included."""
    found = []
    for layer in jax.tree.leaves(tree, is_leaf=_is_layer):
        if _is_layer(layer):
            found += [getattr(layer, name) for name in layer.recurrence_fields]
            inside = jax.tree.leaves(
                layer, is_leaf=lambda x: x is not layer and _is_layer(x)
            )
            found += _recurrence_parameters([x for x in inside if _is_layer(x)])
    return found


def ssm_param_labels(model: PyTree) -> PyTree[str | None]:
    """Label a model's parameters `"ssm"` or `"regular"` for `optax.multi_transform`.

    S5 and LRU train their recurrence parameters with a smaller learning rate and no
    weight decay (Smith et al., 2023; Orvieto et al., 2023); Mamba's and the
    RG-LRU's decay parameters go without weight decay too. `"ssm"` marks, inside
    `model`, the `recurrence_fields` of every
    [`eqx_seq.AbstractRecurrentLayer`][] (a user's own included): in every
    [`eqx_seq.S5`][] and [`eqx_seq.LRU`][], the per-state parameters (S5:
    `lambda_re`, `lambda_im`, `log_step`; LRU: `nu_log`, `theta_log`,
    `gamma_log`) and the input matrix `B`; in every [`eqx_seq.Mamba`][] and
    [`eqx_seq.Mamba2`][], `A_log`, `D` and `dt_bias`; in every
    [`eqx_seq.RGLRU`][], `a_param`. Every other floating array is `"regular"`, and
    everything else `None`, so the labels have the structure of
    `eqx.filter(model, eqx.is_inexact_array)`.

    **Arguments:**

    - `model`: any PyTree, e.g. an Equinox model containing S5 or LRU layers.

    **Returns:**

    A PyTree of labels with the structure of `eqx.filter(model, eqx.is_inexact_array)`.

    Pass the function itself to `optax.multi_transform`, which calls it on the
    parameters: an Equinox model is callable, so a tree of labels shaped like one
    would be mistaken by optax for a labelling function.

    !!! Example

        ```python
        import equinox as eqx, jax.random as jr, optax
        import eqx_seq

        model = eqx_seq.S5Block(eqx_seq.S5(8, 16, key=jr.key(0)), key=jr.key(1))
        optim = optax.multi_transform(
            {"ssm": optax.adam(1e-3), "regular": optax.adamw(4e-3, weight_decay=0.05)},
            eqx_seq.ssm_param_labels,
        )
        opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
        ```
    """
    labels = jax.tree.map(
        lambda x: "regular" if eqx.is_inexact_array(x) else None, model
    )
    count = len(_recurrence_parameters(labels))
    if count == 0:
        return labels
    return eqx.tree_at(_recurrence_parameters, labels, replace=["ssm"] * count)


def s5_optimizer(
    learning_rate: Real[ArrayLike, ""] | optax.Schedule,
    *,
    ssm_learning_rate: Real[ArrayLike, ""] | optax.Schedule | None = None,
    weight_decay: float = 0.05,
) -> optax.GradientTransformation:
    """The S5 training recipe as one `optax` transformation.

    Adam at `ssm_learning_rate` without weight decay for the SSM parameters (see
    [`eqx_seq.ssm_param_labels`][]); AdamW at `learning_rate` with `weight_decay`
    for everything else (Smith et al., 2023).

    **Arguments:**

    - `learning_rate`: for the regular parameters (a float, a scalar array or an
        optax schedule).
    - `ssm_learning_rate`: for the SSM parameters; defaults to `learning_rate`.
    - `weight_decay`: AdamW's decoupled weight decay for the regular parameters.

    **Returns:**

    An `optax.GradientTransformation`; initialise it with
    `eqx.filter(model, eqx.is_inexact_array)`.
    """
    for name, rate in [
        ("learning_rate", learning_rate),
        ("ssm_learning_rate", ssm_learning_rate),
    ]:
        if rate is not None and not callable(rate):
            check_real(name, rate, nonnegative=True)
    check_real("weight_decay", weight_decay, nonnegative=True)
    ssm = learning_rate if ssm_learning_rate is None else ssm_learning_rate
    return optax.multi_transform(
        {
            "ssm": optax.adam(ssm),
            "regular": optax.adamw(learning_rate, weight_decay=weight_decay),
        },
        ssm_param_labels,
    )
