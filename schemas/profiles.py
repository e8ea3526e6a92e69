"""A job's GPU utilisation profile as the API shows it (`alnair job`, HTTP, the dashboard)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class JobProfile(BaseModel):
    """What a job does with the GPUs it holds, computed by the brain from telemetry.

    Utilisation is the mean over the job's GPUs, in percent; memory is in MiB on the
    job's busiest GPU. The forecast covers the next `horizon_s` seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str = Field(min_length=1, max_length=64)
    attempt: int = Field(ge=0)
    updated_at: float
    gpus: int = Field(ge=0, description="GPUs the profiled run held")
    samples: int = Field(ge=0, description="GPU samples the profile is computed from")
    observed_s: float = Field(ge=0, description="seconds of telemetry behind the profile")
    mean_util_pct: float = Field(ge=0, le=100)
    p95_util_pct: float = Field(ge=0, le=100)
    mem_peak_mib: float = Field(ge=0)
    period_s: float | None = Field(
        default=None, description="the job's detected cycle (autocorrelation), if any"
    )
    forecast_util_pct: float = Field(ge=0, le=100)
    forecast_mem_mib: float = Field(ge=0)
    horizon_s: float = Field(gt=0, description="the window the forecast covers")
    underused: bool = Field(description="the job holds GPUs it barely uses")
    idle_gpus: int = Field(ge=0, description="held GPUs below the barely-used line")
