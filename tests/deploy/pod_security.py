"""Pod Security Standards, offline: the strictest level (restricted, baseline, privileged) a pod
template meets, with the reasons it misses the stricter ones. The controls are those of the
Kubernetes 1.32 standards that pod templates can touch (host namespaces and ports, privileged
containers, capabilities, hostPath and other volume types, privilege escalation, non-root users,
seccomp)."""
from __future__ import annotations

LEVELS = ("privileged", "baseline", "restricted")  # weakest first
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def baseline_violations(spec: dict) -> list[str]:
    out = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key}")
    for volume in spec.get("volumes") or []:
        if "hostPath" in volume:
            out.append(f"hostPath volume {volume['name']}")
    pod_seccomp = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        out.append("seccomp Unconfined")
    for c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        extra = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if extra:
            out.append(f"{c['name']}: adds {sorted(extra)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{c['name']}: hostPort")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"{c['name']}: seccomp Unconfined")
    return out


def restricted_violations(spec: dict) -> list[str]:
    out = baseline_violations(spec)
    pod_sc = spec.get("securityContext") or {}
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if kinds - RESTRICTED_VOLUMES and "hostPath" not in kinds:
            out.append(f"volume {volume['name']}: {sorted(kinds)}")
    for c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation not false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{c['name']}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{c['name']}: runs as root")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{c['name']}: no RuntimeDefault seccomp profile")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{c['name']}: does not drop ALL capabilities")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(f"{c['name']}: adds {sorted(extra)}")
    return out


def level(spec: dict) -> tuple[str, list[str]]:
    """The strictest level the pod spec meets, and what keeps it from restricted."""
    restricted = restricted_violations(spec)
    if not restricted:
        return "restricted", []
    return ("baseline" if not baseline_violations(spec) else "privileged"), restricted


def weakest(levels: list[str]) -> str:
    return min(levels, key=LEVELS.index) if levels else "restricted"
