"""Deterministic synthetic demo data for the shipped policies (schemas/health.yaml, adult.yaml).

The hospital table starts with the ten rows of the seeds' differencing-attack example
(row 9 is Igor: single, male, zip 2138, white, obesity) so the attack can be replayed.
Data generation uses a seeded PRNG on purpose: it is fixture data, not noise.
"""

from __future__ import annotations

import bisect
import datetime as dt
import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpsql.localdp import RandomizedResponse
from dpsql.version import __version__

SCHEMAS_DIR = Path(__file__).resolve().parent.parent.parent / "schemas"

Columns = list[tuple[str, str]]
Rows = list[tuple[Any, ...]]

HEALTH_COLUMNS: Columns = [
    ("name", "TEXT"),
    ("ssn", "TEXT"),
    ("marital_status", "TEXT"),
    ("sex", "TEXT"),
    ("dob", "DATE"),
    ("zip", "INTEGER"),
    ("ethnicity", "TEXT"),
    ("problem", "TEXT"),
    ("age", "INTEGER"),
    ("bmi", "DOUBLE PRECISION"),
    ("visits", "INTEGER"),
]

#: The seeds' ten patients (marital status, sex, zip, ethnicity, problem, DOB); index 9 is Igor.
SEED_PATIENTS: list[tuple[str, str, int, str, str, str]] = [
    ("Divorced", "Male", 2139, "Asian", "Hypertension", "1993-03-11"),
    ("Divorced", "Female", 2139, "Asian", "Obesity", "1996-06-27"),
    ("Married", "Female", 2139, "Asian", "Chest pain", "1994-01-30"),
    ("Married", "Female", 2139, "Asian", "Obesity", "1996-09-22"),
    ("Married", "Male", 2148, "Black", "Hypertension", "1991-05-05"),
    ("Married", "Male", 2138, "Black", "Shortness of breath", "1990-12-01"),
    ("Married", "Female", 2141, "Black", "Shortness of breath", "1992-08-14"),
    ("Married", "Male", 2141, "Black", "Obesity", "1995-07-23"),
    ("Single", "Female", 2138, "White", "Chest pain", "1997-04-02"),
    ("Single", "Male", 2138, "White", "Obesity", "1995-02-18"),
]

_PROBLEMS = ["Hypertension", "Obesity", "Chest pain", "Shortness of breath", "Diabetes", "Asthma", "None"]
_ETHNICITIES = ["Asian", "Black", "Hispanic", "White", "Other"]
_MARITAL = ["Single", "Married", "Divorced", "Widowed"]
_REFERENCE_DAY = dt.date(2026, 1, 1)


class _Choice:
    """``int(rng.choice(len(p), p=p))`` for one draw, drawing exactly what numpy draws (its own recipe:
    one ``random()`` searched, side right, in the normalised cumulative sum of ``p``) without its per-call
    checks of ``p``, which made generating the demo take seconds in every process that loads it."""

    def __init__(self, p: Sequence[float]) -> None:
        cdf = np.asarray(p, dtype=np.float64).cumsum()
        cdf /= cdf[-1]
        self._cdf = cdf.tolist()

    def __call__(self, rng: np.random.Generator) -> int:
        return bisect.bisect_right(self._cdf, rng.random())


_ETHNICITY_P = _Choice([0.12, 0.14, 0.18, 0.5, 0.06])
_MARITAL_P = _Choice([0.35, 0.45, 0.13, 0.07])
_PROBLEM_P = _Choice([0.2, 0.15, 0.12, 0.1, 0.13, 0.1, 0.2])


def _age(dob: dt.date) -> int:
    return (_REFERENCE_DAY - dob).days // 365


def health_rows(n: int = 10_000, seed: int = 2026) -> Rows:
    """The seeds' ten patients, then ``n - 10`` synthetic ones (never Single White Males in 2138)."""
    rng = np.random.default_rng(seed)
    rows: Rows = []
    for i, (marital, sex, zip_code, ethnicity, problem, dob_text) in enumerate(SEED_PATIENTS):
        dob = dt.date.fromisoformat(dob_text)
        name = "Igor" if i == 9 else f"Seed patient {i}"
        rows.append((name, f"000-00-{i:04d}", marital, sex, dob, zip_code, ethnicity, problem, _age(dob), 31.0, 3))
    start = dt.date(1930, 1, 1).toordinal()
    for i in range(10, n):
        dob = dt.date.fromordinal(start + int(rng.integers(0, 365 * 75)))
        sex = "Female" if rng.random() < 0.52 else "Male"
        ethnicity = _ETHNICITIES[_ETHNICITY_P(rng)]
        zip_code = int(rng.integers(2100, 2200))
        marital = _MARITAL[_MARITAL_P(rng)]
        if marital == "Single" and sex == "Male" and ethnicity == "White" and zip_code == 2138:
            zip_code = 2139  # keep Igor unique in his quasi-identifiers, as in the seeds
        problem = _PROBLEMS[_PROBLEM_P(rng)]
        bmi = min(max(float(rng.normal(33.0 if problem == "Obesity" else 25.5, 4.0)), 14.0), 58.0)
        bmi_value: float | None = None if rng.random() < 0.02 else round(bmi, 1)
        rows.append(
            (
                f"Patient {i}",
                f"{int(rng.integers(100, 900)):03d}-{int(rng.integers(10, 99)):02d}-{i:04d}",
                marital,
                sex,
                dob,
                zip_code,
                ethnicity,
                problem,
                _age(dob),
                bmi_value,
                int(rng.poisson(4)),
            )
        )
    return rows


ADULT_COLUMNS: Columns = [
    ("age", "INTEGER"),
    ("workclass", "TEXT"),
    ("education", "TEXT"),
    ("education_num", "INTEGER"),
    ("marital_status", "TEXT"),
    ("occupation", "TEXT"),
    ("sex", "TEXT"),
    ("race", "TEXT"),
    ("hours_per_week", "INTEGER"),
    ("capital_gain", "DOUBLE PRECISION"),
    ("native_country", "TEXT"),
    ("income", "TEXT"),
]

_EDUCATION = [
    "Preschool",
    "1st-4th",
    "5th-6th",
    "7th-8th",
    "9th",
    "10th",
    "11th",
    "12th",
    "HS-grad",
    "Some-college",
    "Assoc-voc",
    "Assoc-acdm",
    "Bachelors",
    "Masters",
    "Prof-school",
    "Doctorate",
]
_EDU_P = [
    0.002,
    0.005,
    0.01,
    0.02,
    0.016,
    0.029,
    0.036,
    0.013,
    0.322,
    0.224,
    0.042,
    0.033,
    0.164,
    0.053,
    0.018,
    0.013,
]
_WORKCLASS = [
    "Private",
    "Self-emp-not-inc",
    "Self-emp-inc",
    "Federal-gov",
    "Local-gov",
    "State-gov",
    "Without-pay",
    "Never-worked",
]
_WORK_P = [0.70, 0.08, 0.035, 0.03, 0.065, 0.04, 0.02, 0.03]
_MARITAL_ADULT = ["Married-civ-spouse", "Never-married", "Divorced", "Separated", "Widowed"]
_OCCUPATIONS = [
    "Prof-specialty",
    "Craft-repair",
    "Exec-managerial",
    "Adm-clerical",
    "Sales",
    "Other-service",
    "Machine-op-inspct",
    "Transport-moving",
    "Tech-support",
    "Farming-fishing",
]
_RACES = ["White", "Black", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other"]
_COUNTRIES = ["United-States", "Mexico", "Philippines", "Germany", "Canada", "India", "Cuba", "England"]


def adult_rows(n: int = 32_561, seed: int = 1994) -> Rows:
    """Synthetic census rows with plausible marginals and an income that depends on education."""
    rng = np.random.default_rng(seed)
    edu = rng.choice(16, size=n, p=np.array(_EDU_P) / sum(_EDU_P))
    ages = np.clip(rng.normal(38.6, 13.6, size=n), 17, 90).astype(int)
    hours = np.clip(rng.normal(40.4, 12.3, size=n), 1, 99).astype(int)
    work, marital, race = (
        _Choice(_WORK_P),
        _Choice([0.46, 0.33, 0.14, 0.03, 0.04]),
        _Choice([0.854, 0.096, 0.032, 0.01, 0.008]),
    )
    country = _Choice([0.91, 0.03, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01])
    rows: Rows = []
    for i in range(n):
        e = int(edu[i])
        rich = rng.random() < min(0.9, 0.05 + 0.04 * e + (0.1 if hours[i] > 45 else 0))
        gain = float(round(rng.exponential(8000.0), 2)) if rng.random() < 0.08 else 0.0
        rows.append(
            (
                int(ages[i]),
                None if rng.random() < 0.05 else _WORKCLASS[work(rng)],
                _EDUCATION[e],
                e + 1,
                _MARITAL_ADULT[marital(rng)],
                _OCCUPATIONS[int(rng.integers(0, len(_OCCUPATIONS)))],
                "Male" if rng.random() < 0.67 else "Female",
                _RACES[race(rng)],
                int(hours[i]),
                min(gain, 100000.0),
                _COUNTRIES[country(rng)],
                ">50K" if rich else "<=50K",
            )
        )
    return rows


# --- the multi-table clinic (schemas/clinic.yaml): persons with many rows -------------------

CLINIC_PATIENTS: Columns = [
    ("id", "INTEGER"),
    ("household_id", "INTEGER"),
    ("name", "TEXT"),
    ("age", "INTEGER"),
    ("sex", "TEXT"),
    ("zip", "INTEGER"),
]
CLINIC_VISITS: Columns = [
    ("id", "INTEGER"),
    ("patient_id", "INTEGER"),
    ("department", "TEXT"),
    ("visit_date", "DATE"),
    ("cost", "DOUBLE PRECISION"),
    ("urgent", "BOOLEAN"),
]
CLINIC_PRESCRIPTIONS: Columns = [
    ("id", "INTEGER"),
    ("patient_id", "INTEGER"),
    ("drug", "TEXT"),
    ("dose_mg", "INTEGER"),
]
CLINIC_DEPARTMENTS: Columns = [("name", "TEXT"), ("floor", "INTEGER"), ("building", "TEXT")]
DEPARTMENTS = [
    ("Cardiology", 3, "North"),
    ("Oncology", 4, "North"),
    ("Pediatrics", 1, "South"),
    ("Emergency", 0, "South"),
    ("Dermatology", 2, "East"),
    ("Neurology", 5, "North"),
]
DRUGS = ["Atorvastatin", "Metformin", "Lisinopril", "Amoxicillin", "Ibuprofen", "Insulin"]
#: Patients with hundreds of rows: what contribution bounding exists for.
HEAVY_PATIENTS = (7, 42, 1000)


def _clinic(n_patients: int = 2000, seed: int = 7) -> dict[str, Rows]:
    rng = np.random.default_rng(seed)
    patients: Rows = []
    visits: Rows = []
    prescriptions: Rows = []
    start = dt.date(2020, 1, 1).toordinal()
    for pid in range(1, n_patients + 1):
        household = (pid + 1) // 2  # two patients per household
        patients.append(
            (
                pid,
                household,
                f"Patient {pid}",
                int(rng.integers(0, 100)),
                "Female" if rng.random() < 0.5 else "Male",
                int(rng.integers(2100, 2200)),
            )
        )
        heavy = pid in HEAVY_PATIENTS
        for _ in range(300 if heavy else int(rng.poisson(5))):
            department = "Oncology" if heavy else DEPARTMENTS[int(rng.integers(0, len(DEPARTMENTS)))][0]
            visits.append(
                (
                    len(visits) + 1,
                    pid,
                    department,
                    dt.date.fromordinal(start + int(rng.integers(0, 1800))),
                    round(float(rng.gamma(2.0, 150.0)), 2) if not heavy else 4999.0,
                    bool(rng.random() < 0.1),
                )
            )
        for _ in range(150 if heavy else int(rng.poisson(2))):
            prescriptions.append(
                (
                    len(prescriptions) + 1,
                    pid,
                    DRUGS[int(rng.integers(0, len(DRUGS)))],
                    int(rng.integers(1, 100)) * 10,
                )
            )
    return {
        "patients": patients,
        "visits": visits,
        "prescriptions": prescriptions,
        "departments": DEPARTMENTS,
    }


def clinic_tables() -> list[tuple[str, Columns, Any]]:
    data = _clinic()
    return [
        ("patients", CLINIC_PATIENTS, lambda: data["patients"]),
        ("visits", CLINIC_VISITS, lambda: data["visits"]),
        ("prescriptions", CLINIC_PRESCRIPTIONS, lambda: data["prescriptions"]),
        ("departments", CLINIC_DEPARTMENTS, lambda: data["departments"]),
    ]


SURVEY_COLUMNS: Columns = [("respondent", "TEXT"), ("region", "TEXT"), ("age", "INTEGER"), ("smoker", "BOOLEAN"),
                          ("drug_use", "TEXT")]  # fmt: skip


def survey_rows(n: int = 5000, seed: int = 11) -> Rows:
    """Respondents as *stored*: the sensitive answers already perturbed by randomized response
    (as the write path would have stored them; the truth is 22% smokers, 70/22/8% drug use)."""
    rng = np.random.default_rng(seed)
    smoker, drugs = RandomizedResponse(1.0, (False, True)), RandomizedResponse(1.5, ("never", "past", "current"))
    drug_use = _Choice([0.7, 0.22, 0.08])
    rows: Rows = []
    for i in range(n):
        truth_smoker = bool(rng.random() < 0.22)
        truth_drugs = ("never", "past", "current")[drug_use(rng)]
        rows.append((f"r{i}", ("North", "South", "East", "West")[i % 4], int(rng.integers(18, 99)),
                     smoker.perturb(truth_smoker), drugs.perturb(truth_drugs)))  # fmt: skip
    return rows


#: dataset name -> (table, columns, row factory); the clinic's tables are built together.
DEMO_TABLES: dict[str, Any] = {
    "health": lambda: [("patients", HEALTH_COLUMNS, health_rows)],
    "adult": lambda: [("adult", ADULT_COLUMNS, adult_rows)],
    "clinic": lambda: clinic_tables(),
    "clinic_households": lambda: clinic_tables(),
    "survey": lambda: [("survey", SURVEY_COLUMNS, survey_rows)],
}


def demo_policy_path(dataset: str) -> Path:
    return SCHEMAS_DIR / f"{dataset}.yaml"


def load_demo(backend: Any, datasets: Iterable[str] = ("health", "adult")) -> None:
    """Create and fill the demo tables of ``datasets`` in ``backend`` (drops existing ones)."""
    for dataset in datasets:
        for table, columns, factory in DEMO_TABLES[dataset]():
            backend.execute_script(f"DROP TABLE IF EXISTS {table}")
            backend.load_rows(table, columns, factory())


def demo_identity(datasets: Iterable[str]) -> str:
    """A name for the demo data that every process generating it computes alike: the datasets, dpsql's
    version and a digest of this module (the seeded generator). Equal name, equal rows."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return f"demo:{','.join(sorted(datasets))}:{__version__}:{digest}"
