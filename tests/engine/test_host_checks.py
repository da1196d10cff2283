"""The start-up warning about the kernel's scheduler autogroup on a CPU host."""

from engine_service.cpu_host.host_checks import autogroup_warning


def test_a_cpu_engine_on_a_host_with_autogroup_on_is_warned_with_the_remedies(tmp_path):
    setting = tmp_path / "sched_autogroup_enabled"
    setting.write_text("1\n")
    warning = autogroup_warning(on_cpu=True, setting=setting)
    assert warning.startswith(f"{setting} is 1: ")
    assert "--router-timeout" in warning and "kernel.sched_autogroup_enabled=0" in warning
    assert "one session" in warning


def test_no_warning_with_autogroup_off_missing_or_on_a_gpu(tmp_path):
    setting = tmp_path / "sched_autogroup_enabled"
    setting.write_text("0\n")
    assert autogroup_warning(on_cpu=True, setting=setting) is None
    assert autogroup_warning(on_cpu=True, setting=tmp_path / "absent") is None
    setting.write_text("1\n")
    assert autogroup_warning(on_cpu=False, setting=setting) is None
