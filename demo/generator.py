"""Synthetic card transactions with account history and a known fraud process.

Each sample is the *current* transaction of one account: ``FEATURE_NAMES`` tabular values of the
transaction and the account, plus the account's recent history, a ``(T, len(HISTORY_FIELDS))``
array of earlier transactions, oldest first (the last row is the one just before the current
transaction). Everything is drawn from one seeded ``numpy.random.Generator``, so a seed fixes the
data exactly.

The process, per account (``docs/demo-model.md`` explains it at more length):

1. **Habits.** A typical log amount ``mu`` (normal around log 45) and spread ``sigma``; an online
   share; a travel share (country mismatch); a mean gap between transactions (log-normal, about
   18 h); preferences over ``N_MCC`` merchant buckets (Dirichlet); a new-merchant share; a preferred
   hour of day; 4 % of accounts are travelling (recent rows and the current one abroad). History
   rows are drawn from these habits.
2. **History length.** 1.5 % of accounts are new (0..3 rows), 94.5 % have 4..64 rows, 4 % have
   65..200 rows (longer than the TensorRT profile, so the fallback engine is exercised). Length
   does not depend on fraud.
3. **Compromise.** An account is compromised with probability ``sigmoid(-3.35 + 0.7 [age < 90 d]
   + 0.4 [online share > 0.6])`` (about 3.7 %). A compromised account's current transaction is
   fraud of one of three kinds:

   * *card testing* (35 %): the last 3..12 history rows are replaced by a burst of tiny
     (0.5..6) transactions minutes apart, mostly online at new digital-goods merchants; the current
     transaction is then a raised (1.6..12 times typical) online purchase minutes later;
   * *account takeover* (40 %): the current amount jumps 6..33 times above the account's own
     typical amount, at a new merchant (electronics, travel, cash-like), from a device seen for the
     first time, often at night and with address verification failing; the last rows often show
     new merchants;
   * *cross-border* (25 %): a counterfeit or stolen card used abroad (country mismatch, far from
     home), often card-present without PIN, with a moderately raised amount.

   Every signal is present only with some probability, and legitimate accounts show each one
   too (big purchases 6 %, travel, quick successive purchases 8 %, bursts inside 3 % of
   histories, new devices 5 %), so no single signal separates the classes.
4. **Labels.** Fraud is reported (label 1) with probability 0.93; a legitimate transaction is
   labelled 1 with probability 0.004 (friendly fraud, disputes). Label noise caps the attainable
   AUC near 0.95.

`model_inputs` and `pad_histories` turn samples into the three ONNX inputs of the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "FEATURE_NAMES",
    "FEATURE_RANGES",
    "HISTORY_FIELDS",
    "MCC_BUCKETS",
    "DemoData",
    "generate",
    "model_inputs",
    "pad_histories",
]

FEATURE_NAMES: tuple[str, ...] = (
    "amount",
    "log_amount",
    "mcc_bucket",
    "mcc_risk",
    "is_online",
    "card_present",
    "hour_sin",
    "hour_cos",
    "is_weekend",
    "account_age_days",
    "credit_limit",
    "balance",
    "utilisation",
    "amount_to_limit",
    "country_mismatch",
    "distance_from_home_km",
    "device_age_days",
    "is_new_device",
    "merchant_is_new",
    "hours_since_prev",
    "avg_amount_90d",
    "txn_count_30d",
    "cvv_match",
    "avs_match",
    "three_ds_authenticated",
    "pin_used",
    "is_recurring",
    "customer_age_years",
    "num_cards",
    "chargebacks_past_year",
    "email_age_days",
)

HISTORY_FIELDS: tuple[str, ...] = (
    "log_amount",
    "hours_since_prev",
    "mcc_bucket",
    "is_new_merchant",
    "is_online",
    "country_mismatch",
    "hour_sin",
    "hour_cos",
)

# The valid range of each feature, declared in the model's manifest (a value outside is refused).
# Wide enough for any real transaction, not only this process's: flags are 0 or 1, the
# cyclic hour in [-1, 1], and amounts, ages and distances far beyond anything generated.
FEATURE_RANGES: dict[str, tuple[float, float]] = {
    "amount": (0.0, 1e9),
    "log_amount": (-10.0, 25.0),
    "mcc_bucket": (0.0, 9.0),
    "mcc_risk": (0.0, 1.0),
    "is_online": (0.0, 1.0),
    "card_present": (0.0, 1.0),
    "hour_sin": (-1.0, 1.0),
    "hour_cos": (-1.0, 1.0),
    "is_weekend": (0.0, 1.0),
    "account_age_days": (0.0, 36500.0),
    "credit_limit": (0.0, 1e9),
    "balance": (-1e9, 1e9),
    "utilisation": (-100.0, 100.0),
    "amount_to_limit": (0.0, 1e6),
    "country_mismatch": (0.0, 1.0),
    "distance_from_home_km": (0.0, 1e6),
    "device_age_days": (0.0, 1e5),
    "is_new_device": (0.0, 1.0),
    "merchant_is_new": (0.0, 1.0),
    "hours_since_prev": (0.0, 1e6),
    "avg_amount_90d": (0.0, 1e9),
    "txn_count_30d": (0.0, 1e5),
    "cvv_match": (0.0, 1.0),
    "avs_match": (0.0, 1.0),
    "three_ds_authenticated": (0.0, 1.0),
    "pin_used": (0.0, 1.0),
    "is_recurring": (0.0, 1.0),
    "customer_age_years": (0.0, 150.0),
    "num_cards": (0.0, 1000.0),
    "chargebacks_past_year": (0.0, 10000.0),
    "email_age_days": (0.0, 36500.0),
}

MCC_BUCKETS: tuple[str, ...] = (
    "grocery",
    "fuel",
    "restaurants",
    "retail",
    "travel",
    "digital_goods",
    "electronics",
    "gambling",
    "utilities",
    "cash_like",
)
N_MCC = len(MCC_BUCKETS)
_MCC_RISK = np.array([0.2, 0.3, 0.2, 0.4, 0.7, 0.9, 0.8, 0.9, 0.1, 1.0])
_MCC_DIGITAL, _MCC_TRAVEL, _MCC_ELECTRONICS, _MCC_CASH = 5, 4, 6, 9

_SHORT_SHARE, _LONG_SHARE = 0.015, 0.04
_FRAUD_REPORTED, _LEGIT_DISPUTED = 0.93, 0.004
_CARD_TESTING, _TAKEOVER, _CROSS_BORDER = 1, 2, 3

_F = {name: i for i, name in enumerate(FEATURE_NAMES)}
_H = {name: i for i, name in enumerate(HISTORY_FIELDS)}


@dataclass(frozen=True)
class DemoData:
    """``n`` current transactions, their accounts' histories and their fraud labels."""

    entity_ids: list[str]
    features: np.ndarray  # (n, len(FEATURE_NAMES)) float32
    histories: list[np.ndarray]  # each (T_i, len(HISTORY_FIELDS)) float32, T_i >= 0
    labels: np.ndarray  # (n,) int8, 1 = reported fraud


@dataclass(frozen=True)
class _Accounts:
    """Per-account habits (step 1 of the process), each an array of length n."""

    mu: np.ndarray
    sigma: np.ndarray
    p_online: np.ndarray
    p_abroad: np.ndarray
    mean_gap_h: np.ndarray
    mcc_cdf: np.ndarray  # (n, N_MCC)
    p_new_merchant: np.ndarray
    peak_hour: np.ndarray
    age_days: np.ndarray
    length: np.ndarray
    travelling: np.ndarray  # abroad now: the last rows and (mostly) the current one
    travel_rows: np.ndarray


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _draw_mcc(rng: np.random.Generator, cdf: np.ndarray) -> np.ndarray:
    u = rng.random(cdf.shape[0])
    return np.minimum((u[:, None] > cdf).sum(axis=1), N_MCC - 1)


def _draw_hour(rng: np.random.Generator, peak: np.ndarray) -> np.ndarray:
    return np.mod(peak + rng.normal(0.0, 4.0, peak.shape[0]), 24.0)


def _accounts(rng: np.random.Generator, n: int) -> _Accounts:
    u = rng.random(n)
    length = rng.integers(4, 65, n)
    short = u < _SHORT_SHARE
    long = u > 1.0 - _LONG_SHARE
    length[short] = rng.integers(0, 4, int(short.sum()))
    length[long] = rng.integers(65, 201, int(long.sum()))
    age = rng.gamma(2.0, 400.0, n) + 1.0
    age[short] = rng.uniform(1.0, 30.0, int(short.sum()))
    prefs = rng.gamma(0.5, size=(n, N_MCC)) + 1e-9
    return _Accounts(
        mu=rng.normal(np.log(45.0), 1.0, n),
        sigma=rng.uniform(0.35, 0.8, n),
        p_online=rng.beta(2.0, 3.0, n),
        p_abroad=rng.beta(0.5, 20.0, n),
        mean_gap_h=np.exp(rng.normal(np.log(18.0), 0.6, n)),
        mcc_cdf=np.cumsum(prefs / prefs.sum(axis=1, keepdims=True), axis=1),
        p_new_merchant=rng.beta(2.0, 12.0, n),
        peak_hour=rng.normal(14.0, 3.0, n),
        age_days=age,
        length=length,
        travelling=rng.random(n) < 0.04,
        travel_rows=rng.integers(1, 7, n),
    )


def _fraud_kind(rng: np.random.Generator, acc: _Accounts) -> np.ndarray:
    """0 for a legitimate current transaction, else the kind of fraud (step 3)."""
    n = acc.mu.shape[0]
    logit = -3.35 + 0.7 * (acc.age_days < 90) + 0.4 * (acc.p_online > 0.6)
    compromised = rng.random(n) < _sigmoid(logit)
    kind = rng.choice([_CARD_TESTING, _TAKEOVER, _CROSS_BORDER], size=n, p=[0.35, 0.40, 0.25])
    # card testing needs rows to overwrite; such accounts are taken over instead
    kind[(kind == _CARD_TESTING) & (acc.length < 3)] = _TAKEOVER
    return np.where(compromised, kind, 0)


def _history_rows(rng: np.random.Generator, acc: _Accounts, kind: np.ndarray) -> np.ndarray:
    """All history rows of all accounts, concatenated in account order (step 1 and 3)."""
    owner = np.repeat(np.arange(acc.length.shape[0]), acc.length)
    total = owner.shape[0]
    starts = np.cumsum(acc.length) - acc.length
    pos = np.arange(total) - starts[owner]
    from_end = acc.length[owner] - 1 - pos  # 0 is the row just before the current transaction

    rows = np.empty((total, len(HISTORY_FIELDS)), np.float64)
    log_amount = acc.mu[owner] + acc.sigma[owner] * rng.normal(size=total)
    gap_h = rng.exponential(acc.mean_gap_h[owner])
    mcc = _draw_mcc(rng, acc.mcc_cdf[owner])
    new_merchant = rng.random(total) < acc.p_new_merchant[owner]
    online = rng.random(total) < acc.p_online[owner]
    abroad = rng.random(total) < acc.p_abroad[owner]
    hour = _draw_hour(rng, acc.peak_hour[owner])

    travel = acc.travelling[owner] & (from_end < acc.travel_rows[owner])
    abroad[travel] = rng.random(int(travel.sum())) < 0.9

    # legitimate bursts: a few quick, ordinary purchases somewhere in the history
    n = acc.length.shape[0]
    has_burst = (rng.random(n) < 0.03) & (acc.length >= 4)
    burst_len = rng.integers(3, 7, n)
    burst_start = (rng.random(n) * np.maximum(acc.length - burst_len, 1)).astype(np.int64)
    in_burst = has_burst[owner] & (pos >= burst_start[owner])
    in_burst &= pos < burst_start[owner] + burst_len[owner]
    gap_h[in_burst] = rng.exponential(0.3, int(in_burst.sum()))
    log_amount[in_burst] -= rng.uniform(0.0, 1.5, int(in_burst.sum()))

    # card testing: the last rows become tiny online purchases minutes apart
    test_len = rng.integers(3, 13, n)
    testing = (kind[owner] == _CARD_TESTING) & (from_end < test_len[owner])
    m = int(testing.sum())
    log_amount[testing] = np.log(rng.uniform(0.5, 6.0, m))
    gap_h[testing] = rng.exponential(0.08, m)
    mcc[testing] = np.where(rng.random(m) < 0.7, _MCC_DIGITAL, mcc[testing])
    new_merchant[testing] |= rng.random(m) < 0.8
    online[testing] |= rng.random(m) < 0.9
    abroad[testing] |= rng.random(m) < 0.3

    # takeover: the fraudster's first steps show as new merchants just before
    takeover = (kind[owner] == _TAKEOVER) & (from_end < rng.integers(0, 3, n)[owner])
    new_merchant[takeover] |= rng.random(int(takeover.sum())) < 0.7

    rows[:, _H["log_amount"]] = log_amount
    rows[:, _H["hours_since_prev"]] = gap_h
    rows[:, _H["mcc_bucket"]] = mcc
    rows[:, _H["is_new_merchant"]] = new_merchant
    rows[:, _H["is_online"]] = online
    rows[:, _H["country_mismatch"]] = abroad
    rows[:, _H["hour_sin"]] = np.sin(2 * np.pi * hour / 24.0)
    rows[:, _H["hour_cos"]] = np.cos(2 * np.pi * hour / 24.0)
    return rows.astype(np.float32)


def _current(rng: np.random.Generator, acc: _Accounts, kind: np.ndarray) -> np.ndarray:
    """Tabular features of each account's current transaction (steps 1 and 3)."""
    n = kind.shape[0]
    legit = kind == 0
    testing, takeover, cross = (kind == k for k in (_CARD_TESTING, _TAKEOVER, _CROSS_BORDER))

    def flag(p_legit: float, p_fraud: dict[int, float]) -> np.ndarray:
        p = np.full(n, p_legit)
        for k, pk in p_fraud.items():
            p[kind == k] = pk
        return (rng.random(n) < p).astype(np.float64)

    log_amount = acc.mu + acc.sigma * rng.normal(size=n)
    big = legit & (rng.random(n) < 0.06)
    log_amount[big] += rng.uniform(1.5, 3.0, int(big.sum()))
    log_amount[testing] = acc.mu[testing] + rng.uniform(0.5, 2.5, int(testing.sum()))
    log_amount[takeover] = acc.mu[takeover] + rng.uniform(1.8, 3.5, int(takeover.sum()))
    log_amount[cross] = acc.mu[cross] + rng.uniform(0.3, 2.0, int(cross.sum()))
    amount = np.maximum(np.exp(log_amount), 0.5)

    mcc = _draw_mcc(rng, acc.mcc_cdf)
    risky = takeover & (rng.random(n) < 0.75)
    mcc[risky] = rng.choice([_MCC_ELECTRONICS, _MCC_TRAVEL, _MCC_CASH], int(risky.sum()))
    mcc[testing & (rng.random(n) < 0.6)] = _MCC_ELECTRONICS

    online = rng.random(n) < acc.p_online
    online[testing] = rng.random(int(testing.sum())) < 0.95
    online[takeover] = rng.random(int(takeover.sum())) < 0.8
    online[cross] = rng.random(int(cross.sum())) < 0.5
    card_present = ~online & (rng.random(n) < 0.97)

    hour = _draw_hour(rng, acc.peak_hour)
    night = takeover & (rng.random(n) < 0.35)
    hour[night] = rng.uniform(0.0, 5.0, int(night.sum()))

    abroad = rng.random(n) < np.where(acc.travelling, 0.9, 2.0 * acc.p_abroad)
    abroad[cross] = rng.random(int(cross.sum())) < 0.9
    abroad[testing] |= rng.random(int(testing.sum())) < 0.2
    distance = np.where(abroad, np.exp(rng.normal(7.0, 0.8, n)), np.exp(rng.normal(2.0, 1.0, n)))

    device_age = np.exp(rng.normal(5.0, 1.2, n))
    new_device = (legit & (rng.random(n) < 0.05)) | (takeover & (rng.random(n) < 0.5))
    new_device |= testing & (rng.random(n) < 0.4)
    device_age[new_device] = rng.uniform(0.0, 1.0, int(new_device.sum()))

    merchant_new = rng.random(n) < acc.p_new_merchant
    merchant_new |= (takeover & (rng.random(n) < 0.6)) | (testing & (rng.random(n) < 0.6))

    hours_since_prev = rng.exponential(acc.mean_gap_h)
    quick = legit & (rng.random(n) < 0.08)
    hours_since_prev[quick] = rng.exponential(0.2, int(quick.sum()))
    hours_since_prev[testing] = rng.exponential(0.1, int(testing.sum()))
    hours_since_prev[acc.length == 0] = 0.0

    credit_limit = np.round(np.exp(rng.normal(np.log(5000.0), 0.6, n)), -2) + 300.0
    balance = credit_limit * rng.beta(2.0, 5.0, n)
    typical = np.exp(acc.mu + 0.5 * acc.sigma**2)
    noise = np.where(acc.length < 4, 0.9, 0.5)
    avg_amount = typical * np.exp(noise * rng.normal(size=n))

    out = np.zeros((n, len(FEATURE_NAMES)), np.float64)
    columns = {
        "amount": amount,
        "log_amount": np.log(amount),
        "mcc_bucket": mcc,
        "mcc_risk": _MCC_RISK[mcc],
        "is_online": online,
        "card_present": card_present,
        "hour_sin": np.sin(2 * np.pi * hour / 24.0),
        "hour_cos": np.cos(2 * np.pi * hour / 24.0),
        "is_weekend": rng.random(n) < 2.0 / 7.0,
        "account_age_days": acc.age_days,
        "credit_limit": credit_limit,
        "balance": balance,
        "utilisation": balance / credit_limit,
        "amount_to_limit": amount / credit_limit,
        "country_mismatch": abroad,
        "distance_from_home_km": distance,
        "device_age_days": device_age,
        "is_new_device": device_age < 1.0,
        "merchant_is_new": merchant_new,
        "hours_since_prev": hours_since_prev,
        "avg_amount_90d": avg_amount,
        "txn_count_30d": rng.poisson(720.0 / acc.mean_gap_h),
        "cvv_match": flag(0.995, {_CARD_TESTING: 0.9, _TAKEOVER: 0.97, _CROSS_BORDER: 0.95}),
        "avs_match": flag(0.97, {_CARD_TESTING: 0.85, _TAKEOVER: 0.75, _CROSS_BORDER: 0.85}),
        "three_ds_authenticated": online * flag(0.5, {_CARD_TESTING: 0.2, _TAKEOVER: 0.35}),
        "pin_used": card_present * flag(0.8, {_CROSS_BORDER: 0.3, _TAKEOVER: 0.6}),
        "is_recurring": flag(0.08, {_CARD_TESTING: 0.01, _TAKEOVER: 0.01, _CROSS_BORDER: 0.01}),
        "customer_age_years": rng.uniform(18.0, 85.0, n),
        "num_cards": 1 + rng.poisson(0.5, n),
        "chargebacks_past_year": rng.poisson(0.05, n),
        "email_age_days": rng.gamma(2.0, 700.0, n),
    }
    for name, values in columns.items():
        out[:, _F[name]] = values
    return out.astype(np.float32)


def generate(n: int, seed: int) -> DemoData:
    """Draw ``n`` independent accounts and their current transactions; the seed fixes all."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    acc = _accounts(rng, n)
    kind = _fraud_kind(rng, acc)
    rows = _history_rows(rng, acc, kind)
    features = _current(rng, acc, kind)
    reported = rng.random(n) < _FRAUD_REPORTED
    disputed = rng.random(n) < _LEGIT_DISPUTED
    labels = np.where(kind > 0, reported, disputed).astype(np.int8)
    ids = rng.integers(0, 2**48, n)
    histories = np.split(rows, np.cumsum(acc.length)[:-1]) if n else []
    return DemoData(
        entity_ids=[f"acct-{i:012x}" for i in ids],
        features=features,
        histories=list(histories),
        labels=labels,
    )


def pad_histories(
    histories: Sequence[np.ndarray], min_length: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Zero-pad histories at the end to a common length ``max(min_length, longest)``.

    Returns ``history`` (n, T, H) float32 and ``history_mask`` (n, T) float32, 1 for a real row.
    """
    n = len(histories)
    width = histories[0].shape[1] if n else len(HISTORY_FIELDS)
    lengths = np.array([h.shape[0] for h in histories], np.int64)
    t = max(min_length, int(lengths.max()) if n else 0)
    history = np.zeros((n, t, width), np.float32)
    mask = np.zeros((n, t), np.float32)
    for i, h in enumerate(histories):
        history[i, : h.shape[0]] = h
        mask[i, : h.shape[0]] = 1.0
    return history, mask


def model_inputs(data: DemoData) -> dict[str, np.ndarray]:
    """The model's three ONNX inputs for ``data``: features, history and history_mask."""
    history, mask = pad_histories(data.histories)
    return {"features": data.features, "history": history, "history_mask": mask}
