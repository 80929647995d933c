"""Slow per-token reference implementations written independently of learner.losses.

Plain Python floats and `math`, one token at a time, with gradients derived by hand; the
tests compare the vectorised torch code (values and autograd gradients) against these.
"""

from __future__ import annotations

import math


def agg_coefficients(
    mask: list[list[int]], mode: str, norm_constant: float | None
) -> list[list[float]]:
    """d(aggregate)/d(per-token loss) for each position."""
    lengths = [sum(row) for row in mask]
    total = sum(lengths)
    sequences = sum(1 for n in lengths if n > 0)
    out = []
    for row, n in zip(mask, lengths):
        coefs = []
        for m in row:
            if not m:
                coefs.append(0.0)
            elif mode == "token_mean":
                coefs.append(1.0 / total)
            elif mode == "seq_mean_token_mean":
                coefs.append(1.0 / (sequences * n))
            elif mode == "seq_mean_token_sum":
                coefs.append(1.0 / sequences)
            elif mode == "seq_sum_norm":
                coefs.append(1.0 / (sequences * norm_constant))
            else:
                raise ValueError(mode)
        out.append(coefs)
    return out


def behaviour_weight_rows(base, sampler, mask, correction, level, low, high):
    """Weights and keep flags, token by token (or sequence by sequence)."""
    weights, keeps = [], []
    for b in range(len(mask)):
        if level == "sequence":
            log_total = sum(base[b][t] - sampler[b][t] for t in range(len(mask[b])) if mask[b][t])
            rhos = [math.exp(log_total)] * len(mask[b])
        else:
            rhos = [math.exp(base[b][t] - sampler[b][t]) for t in range(len(mask[b]))]
        w_row, k_row = [], []
        for rho in rhos:
            if correction == "none":
                w, k = 1.0, True
            elif correction == "tis":
                w = min(rho, high)
                if low is not None:
                    w = max(w, low)
                k = True
            else:
                lo = 0.0 if low is None else low
                hi = math.inf if high is None else high
                k = lo <= rho <= hi
                w = rho if k else 0.0
            w_row.append(w)
            k_row.append(k)
        weights.append(w_row)
        keeps.append(k_row)
    return weights, keeps


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def policy_loss_reference(lp, old, mu, adv, mask, cfg, ref=None):
    """(loss, grad wrt lp) of the configured policy loss; adv is per token (B x T lists)."""
    B, T = len(mask), len(mask[0])
    base = old if cfg.ratio_base == "proximal" else lp
    weights, keeps = behaviour_weight_rows(
        base,
        mu,
        mask,
        cfg.correction,
        cfg.correction_level,
        cfg.correction_low,
        cfg.correction_high,
    )
    agg_mask = [
        [int(mask[b][t] and (cfg.masked_in_denominator or keeps[b][t])) for t in range(T)]
        for b in range(B)
    ]
    coefs = agg_coefficients(agg_mask, cfg.aggregation, cfg.norm_constant)
    values = [[0.0] * T for _ in range(B)]
    grads = [[0.0] * T for _ in range(B)]
    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    for b in range(B):
        n = sum(mask[b])
        seq_log = sum(lp[b][t] - old[b][t] for t in range(T) if mask[b][t]) / max(n, 1)
        s = math.exp(seq_log)
        for t in range(T):
            if not mask[b][t]:
                continue
            a, w = adv[b][t], weights[b][t]
            r = math.exp(lp[b][t] - old[b][t])
            if cfg.surrogate == "reinforce":
                v, dv = -a * lp[b][t], -a
            elif cfg.surrogate == "cispo":
                c = r if cfg.cispo_low is None else max(r, cfg.cispo_low)
                c = min(c, cfg.cispo_high)
                v, dv = -c * a * lp[b][t], -c * a
            elif cfg.surrogate == "ppo":
                unclipped, clipped = -a * r, -a * _clip(r, lo, hi)
                if unclipped >= clipped:
                    v, dv = unclipped, -a * r
                else:
                    v, dv = clipped, 0.0
                if cfg.dual_clip is not None and a < 0 and v > -cfg.dual_clip * a:
                    v, dv = -cfg.dual_clip * a, 0.0
            elif cfg.surrogate in ("gspo", "gspo_token"):
                unclipped, clipped = -a * s, -a * _clip(s, lo, hi)
                v = max(unclipped, clipped)
                dv = -a * s if unclipped >= clipped else 0.0  # d v / d log s
            else:
                raise ValueError(cfg.surrogate)
            v *= w
            dv *= w
            if cfg.kl_coef > 0:
                d = ref[b][t] - lp[b][t]
                if cfg.kl_estimator == "k3":
                    v += cfg.kl_coef * (math.exp(d) - d - 1.0)
                    dv_kl = cfg.kl_coef * (1.0 - math.exp(d))
                else:
                    v += cfg.kl_coef * (lp[b][t] - ref[b][t])
                    dv_kl = cfg.kl_coef
            else:
                dv_kl = 0.0
            values[b][t] = v
            if cfg.surrogate == "gspo":
                # every token's loss depends on log s = mean of the row's log ratios
                for t2 in range(T):
                    if mask[b][t2]:
                        grads[b][t2] += coefs[b][t] * dv / n
                grads[b][t] += coefs[b][t] * dv_kl
            else:
                grads[b][t] += coefs[b][t] * (dv + dv_kl)
    loss = sum(values[b][t] * coefs[b][t] for b in range(B) for t in range(T))
    return loss, grads


def softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) for x in row]
    z = sum(e)
    return [x / z for x in e]


def weight_function(r: float, cfg) -> float:
    """f(r) of a behaviour weight: none 1, tis clip(r, low, high), mis r inside [low, high]."""
    if cfg.weight == "none":
        return 1.0
    if cfg.weight == "tis":
        w = r if cfg.weight_high is None else min(r, cfg.weight_high)
        return w if cfg.weight_low is None else max(w, cfg.weight_low)
    lo = 0.0 if cfg.weight_low is None else cfg.weight_low
    hi = math.inf if cfg.weight_high is None else cfg.weight_high
    return r if lo <= r <= hi else 0.0


def score_centering_reference(logits, sampled, mu_logp, topk_ids, topk_logp, adv, mask, cfg):
    """(loss, grad wrt logits) of the score-centering term, position by position."""
    B, T, V = len(logits), len(logits[0]), len(logits[0][0])
    coefs_agg = agg_coefficients(mask, cfg.aggregation, cfg.norm_constant)
    grads = [[[0.0] * V for _ in range(T)] for _ in range(B)]
    loss = 0.0
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            pi = softmax(logits[b][t])
            head = [
                (v, math.exp(lq))
                for v, lq in zip(topk_ids[b][t], topk_logp[b][t])
                if lq != -math.inf
            ]
            tail_mu = max(0.0, 1.0 - sum(m for _, m in head))
            tail_pi = max(1e-6, 1.0 - sum(pi[v] for v, _ in head))
            rho = tail_mu / tail_pi
            alpha = rho * weight_function(1.0 / rho, cfg) if tail_mu > 0 else 0.0
            c = {v: m * weight_function(pi[v] / m, cfg) - alpha * pi[v] for v, m in head}
            a = adv[b][t]
            value = a * sum(cv * math.log(pi[v]) for v, cv in c.items())
            loss += coefs_agg[b][t] * value
            c_total = sum(c.values())
            for j in range(V):
                d = -pi[j] * c_total + c.get(j, 0.0)
                grads[b][t][j] = coefs_agg[b][t] * a * d
    return loss, grads


def outcome_reference(rewards, groups, estimator, eps=1e-6):
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        n = len(members)
        if n < 2:
            out.append(0.0)
            continue
        mean = sum(members) / n
        if estimator == "dr_grpo":
            out.append(r - mean)
        elif estimator == "rloo":
            out.append(r - (sum(members) - r) / (n - 1))
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            out.append((r - mean) / (std + eps))
    return out


def gae_reference(rewards, values, mask, gamma, lam):
    """GAE on each row's loss tokens only (the masked positions removed), scattered back."""
    advs, rets = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        idx = [t for t, m in enumerate(m_row) if m]
        a_row, ret_row = [0.0] * len(m_row), [0.0] * len(m_row)
        running = 0.0
        for k in range(len(idx) - 1, -1, -1):
            t = idx[k]
            next_v = v_row[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r_row[t] + gamma * next_v - v_row[t]
            running = delta + gamma * lam * running
            a_row[t] = running
            ret_row[t] = running + v_row[t]
        advs.append(a_row)
        rets.append(ret_row)
    return advs, rets
