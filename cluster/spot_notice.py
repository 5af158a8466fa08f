"""An EC2 spot node's interruption notice, turned into a Ray node drain.

EC2 warns a spot instance 2 minutes before it takes it back, on the instance metadata
service (IMDSv2: ``/latest/meta-data/spot/instance-action``). Ray learns of a coming loss
only from a drain: this watcher, started next to ``ray start`` on every worker node
(``cluster/aws.yaml``), polls the notice and drains each Ray node of this instance with
reason PREEMPTION and the notice's time as the deadline (what ``ray drain-node`` does).
Ray Train then tells the training workers, which save a checkpoint at once
(``train.preemption_check_s``), and restarts them elsewhere at the deadline; Ray stops
scheduling new work on the node. On an on-demand instance the notice never comes.

On Kubernetes this is not needed: the node's drain sends the pod SIGTERM, and ``ray start
--block`` drains its Ray node itself (``cluster/kuberay``).

    python cluster/spot_notice.py --address $RAY_HEAD_IP:6379
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import time
import urllib.error
import urllib.request

IMDS = "http://169.254.169.254"
TOKEN_TTL_S = 21600
NOTICE_S = 120  # EC2 warns a spot instance this long before it takes it back
DRAIN_MARGIN_S = 60  # of the notice, left between the drain's deadline and the instance's end
LEAST_DRAIN_S = 10  # a notice seen late still gives the workers this long to checkpoint

log = logging.getLogger("spot_notice")


class InstanceMetadata:
    """IMDSv2: a session token, asked for once and reused for its life (TOKEN_TTL_S; asked
    again a minute before it ends, or when the service refuses it), then the notice."""

    def __init__(self, url: str = IMDS):
        self.url, self.token, self.token_until = url, "", 0.0

    def _fresh_token(self) -> str:
        request = urllib.request.Request(
            f"{self.url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=2) as reply:
            self.token = reply.read().decode()
        self.token_until = time.monotonic() + TOKEN_TTL_S - 60
        return self.token

    def interruption_time(self) -> dt.datetime | None:
        """The time of this instance's spot interruption notice, or None while there is none."""
        if not self.token or time.monotonic() >= self.token_until:
            self._fresh_token()
        for last_try in (False, True):
            request = urllib.request.Request(
                f"{self.url}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": self.token}
            )
            try:
                with urllib.request.urlopen(request, timeout=2) as reply:
                    notice = json.loads(reply.read())
                break
            except urllib.error.HTTPError as err:
                if err.code == 404:  # no interruption scheduled
                    return None
                if err.code != 401 or last_try:
                    raise
                self._fresh_token()  # refused (expired early, or the service restarted)
        return dt.datetime.strptime(notice["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)


def drain_deadline(goes_at: dt.datetime, now: dt.datetime, margin_s: float = DRAIN_MARGIN_S) -> dt.datetime:
    """When Ray should move the work off: ``margin_s`` before the instance goes, but never
    less than LEAST_DRAIN_S from now (a notice seen late) nor after the instance goes."""
    wanted = goes_at - dt.timedelta(seconds=margin_s)
    return min(goes_at, max(wanted, now + dt.timedelta(seconds=LEAST_DRAIN_S)))


def drain_this_instance(address: str, deadline: dt.datetime, why: str) -> list[str]:
    """Drain every alive Ray worker node of this instance (its IP) until ``deadline``; their
    ids. (A head node is left alone: this watcher runs on worker nodes, and the head, which
    is on demand, shares an instance with none.)"""
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    gcs = ray._raylet.GcsClient(address=address)
    ip = ray.util.get_node_ip_address()
    alive = gcs.get_all_node_info(timeout=30, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
    ours = [node.hex() for node, info in alive.items() if info.node_manager_address == ip and not info.is_head_node]
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    deadline_ms = int(deadline.timestamp() * 1000)
    for node_id in ours:
        accepted, rejection = gcs.drain_node(node_id, reason, why, deadline_ms)
        log.warning("drained Ray node %s until %s: %s", node_id, deadline.isoformat(), accepted or rejection)
    return ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="the head's GCS, host:port")
    parser.add_argument("--imds", default=IMDS, help="the instance metadata service")
    parser.add_argument("--poll_s", type=float, default=5.0, help="seconds between looks at the notice")
    parser.add_argument(
        "--margin_s",
        type=float,
        default=DRAIN_MARGIN_S,
        help="seconds between the drain's deadline and the notice's time",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    metadata = InstanceMetadata(args.imds)
    while True:
        try:
            when = metadata.interruption_time()
        except (OSError, ValueError) as err:  # the service unreachable for a moment: look again
            log.info("no answer from the metadata service: %s", err)
            when = None
        if when is not None:
            deadline = drain_deadline(when, dt.datetime.now(dt.timezone.utc), args.margin_s)
            drain_this_instance(
                args.address, deadline, f"EC2 spot interruption notice: the instance goes at {when:%H:%M:%S}Z"
            )
            return
        time.sleep(args.poll_s)


if __name__ == "__main__":
    main()
