"""MQTT in a pod of several processes (``serve --processes 2 --mqtt-port``): the pod's first process listens for
MQTT (each session's state lives in the data dir of the process that serves it, so one process serves them all);
the lite topics its sessions publish and subscribe to live on every process of the ring."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from testing_mqtt import Peer

from lmq_broker.supervisor import free_ports
from lmq_broker.testing import start_broker

PARENT = "AGENT_TASK_NS"  # bootstrapped


def test_a_pod_of_two_processes_serves_mqtt_and_keeps_a_session_across_a_reconnect(
    tmp_path: Path, connect: Callable[..., Peer]
) -> None:
    (port,) = free_ports("127.0.0.1", 1)  # one port for the pod, as a Service names it (each process bound it)
    pod = start_broker(tmp_path / "data", extra_args=["--processes", "2", "--mqtt-port", str(port)])
    try:
        assert pod.mqtt_port == port, pod.log()[-2000:]  # in the pod's ready line
        topics = [f"{PARENT}/dev-{n}" for n in range(20)]  # lite topics of both processes
        sub = connect(pod.mqtt_port, "pod-session", clean=False)
        assert sub.subscribe((f"{PARENT}/+", 1)) == [1]
        pub = connect(pod.mqtt_port)
        for topic in topics:
            pub.publish(topic, f"1 {topic}".encode())
        assert sorted(m.payload for m in sub.wait_count(20)) == sorted(f"1 {t}".encode() for t in topics)
        sub.disconnect()
        for topic in topics:  # while the session is away
            pub.publish(topic, f"2 {topic}".encode())
        back = connect(pod.mqtt_port, "pod-session", clean=False)
        assert back.connack is not None and back.connack[0], "the session is present"
        assert sorted(m.payload for m in back.wait_count(20)) == sorted(f"2 {t}".encode() for t in topics)
        assert len(back.quiet()) == 20
    finally:
        assert pod.stop() == 0, pod.log()[-4000:]
