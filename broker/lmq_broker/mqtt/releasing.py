"""QoS 2 deliveries after their PUBLISH (MQTT 3.1.1 and 5.0 sections 4.3.3 and 4.4): the client's PUBREC is
answered PUBREL, its PUBCOMP settles the message (``delivering.Deliveries.settle``), which is when the lite
group's offset moves: a message is never settled before the client has it, nor handed out again after.

For a persistent session the packet id is written to the durable store (``durable.OUTBOUND``), with the
message id, before the PUBREL goes out and forgotten at the PUBCOMP; a resumed session resends a PUBREL for
each, not the PUBLISH (section 4.4), and after a restart (the message's lease died with the process) the
message handed out again (in a cluster also by the broker that owns it, once its lease there ran out) is
settled without being sent (``Deliveries._deliver``), recognised by its message id; so is one whose PUBCOMP
came but whose settling failed (its owner down, its lease given back): its row is forgotten only once the
message is known settled. A retained message sent at QoS 1 or 2 and not acknowledged when the connection
ended (``durable.RESEND``) is sent again after the CONNACK, as the PUBRELs are. A 5.0 PUBREC with a
reason code of 0x80 or more ends the flow (the message is settled: the client refused it); a PUBREC for a
packet id not in flight is answered PUBREL 0x92 (5.0).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Final

from lmq_broker.mqtt import codec, durable, exactly
from lmq_broker.mqtt.delivering import Deliveries, Out
from lmq_broker.mqtt.link import Link
from lmq_broker.mqtt.properties import Reason

log = logging.getLogger(__name__)

MAX_PROMISED: Final = 1024  # packet ids a resumed session keeps for QoS 2 messages published without a PUBREC


class Releases:
    def __init__(self, link: Link, deliveries: Deliveries) -> None:
        self.link = link
        self.deliveries = deliveries

    async def resume(self) -> None:
        """A resumed persistent session: its QoS 2 deliveries awaiting PUBCOMP hold their packet ids again, its
        retained messages not acknowledged too (sent again by ``resend``), and the deliveries published without a
        PUBACK or PUBREC keep theirs for when their message comes again (MQTT-4.4.0-1)."""
        link = self.link
        run, kept = link.dispatcher.run, link.host.durable
        ids = await run(kept.qos2_ids, link.client_id, durable.OUTBOUND)
        for packet_id, message_id in sorted(ids.items()):
            self.deliveries.out[packet_id] = Out("", "", qos=2, released=True, message_id=message_id)
        unreadable = []
        for packet_id, text in sorted((await run(kept.qos2_ids, link.client_id, durable.RESEND)).items()):
            unacked = durable.unacked_of(text)
            if unacked is None or packet_id in self.deliveries.out:  # damaged (or its id a PUBREL's): dropped
                unreadable.append(packet_id)
                continue
            self.deliveries.out[packet_id] = Out("", "", qos=unacked.qos, row=durable.RESEND, unacked=unacked,
                                                 text=text)  # fmt: skip
        if unreadable:
            await run(kept.qos2_update, link.client_id, durable.RESEND, [], unreadable)
        published = await run(kept.qos2_ids, link.client_id, durable.PUBLISHED)
        owed = sorted(published.items())
        if len(owed) > MAX_PROMISED:  # messages that never came back (expired, reclaimed): not kept for ever
            qos1 = await run(kept.qos1_ids, link.client_id, durable.PUBLISHED)
            # QoS 1 rows first (rows of acknowledged deliveries a kill -9 left behind are: lost, a message comes
            # again under a new id with DUP, which QoS 1 allows), then the lowest ids; a QoS 2 one lost comes
            # again under a new id, a new message to the client
            owed.sort(key=lambda row: (row[0] not in qos1, row[0]))
            dropped = [packet_id for packet_id, _ in owed[:-MAX_PROMISED]]
            await run(kept.qos2_update, link.client_id, durable.PUBLISHED, [], dropped)
            owed = owed[-MAX_PROMISED:]
        self.deliveries.promised = {message_id: packet_id for packet_id, message_id in owed
                                     if packet_id not in self.deliveries.out}  # fmt: skip

    async def resend(self) -> None:
        """After the CONNACK (MQTT-4.4.0-1): a PUBREL for each QoS 2 delivery awaiting its PUBCOMP, and each
        retained message not acknowledged again, under its packet id with DUP, as many as the in-flight window
        (5.0: the client's Receive Maximum now, MQTT-3.3.4-9) holds besides the PUBRELs' flows; the others as
        acknowledgements make room (``Deliveries.unsent``)."""
        deliveries = self.deliveries
        for packet_id, out in list(deliveries.out.items()):
            if out.released:
                self.link.writer.write(codec.encode_packet_id(codec.PUBREL, packet_id, 0, self.link.ack_props()))
            elif out.unacked is not None:
                deliveries.unsent.append(packet_id)
        await deliveries.send_unsent()

    async def received(self, packet: codec.PacketId) -> None:
        """PUBREC: the client has the message; PUBREL (its packet id recorded first for a persistent session)."""
        link = self.link
        packet_id = packet.packet_id
        out = self.deliveries.out.get(packet_id)
        if out is None or out.qos != 2:
            reason = Reason.PACKET_ID_NOT_FOUND if link.v5 else 0
            link.writer.write(codec.encode_packet_id(codec.PUBREL, packet_id, reason, link.ack_props()))
            return
        if packet.reason >= Reason.UNSPECIFIED_ERROR and not out.released:  # 5.0: the client refused it
            log.info("mqtt client %s: QoS 2 delivery %d refused with PUBREC %#04x", link.client_id, packet_id,
                     packet.reason)  # fmt: skip
            if link.persistent and (out.message_id or out.row):
                await link.dispatcher.run(link.host.durable.qos2_update, link.client_id, out.row or durable.PUBLISHED,
                                          [], [packet_id])  # fmt: skip
            del self.deliveries.out[packet_id]
            await self.deliveries.settle(packet_id, out)
            return
        if not out.released:
            if link.persistent:  # its PUBLISHED (RESEND) row, if any, becomes the OUTBOUND one, in one transaction
                released = [(packet_id, out.message_id)]
                source = out.row or durable.PUBLISHED
                await link.dispatcher.run(link.host.durable.qos2_released, link.client_id, released, source)
            self.deliveries.out[packet_id] = replace(out, released=True, row="", unacked=None)
        link.writer.write(codec.encode_packet_id(codec.PUBREL, packet_id, 0, link.ack_props()))

    async def completed(self, packet_id: int) -> None:
        """PUBCOMP: the flow is complete; the message settled and the packet id forgotten."""
        out = self.deliveries.out.get(packet_id)
        if out is None or not out.released:
            return  # not ours, or completed twice: nothing to settle
        if not out.receipt and out.message_id and not out.remote:
            # restored after a restart: its message comes again (its lease died), settled then and not sent
            # (``Deliveries.completed``); its packet id stays recorded until then, for a crash before that
            self.deliveries.completed[out.message_id] = packet_id
            del self.deliveries.out[packet_id]
            await self.deliveries.settle(packet_id, out)
            return
        del self.deliveries.out[packet_id]
        if out.remote:  # settled there by the settler, off the reader; its row forgotten once it is settled there
            await self.deliveries.settle(packet_id, out)
            return
        # first: a crash before the row goes leaves a PUBREL, not the message handed out again as a new one
        if not await self.deliveries.settle(packet_id, out) and out.message_id:
            self.deliveries.completed[out.message_id] = packet_id  # its lease was given back: it comes again,
            return  # settled then, unsent; its row kept until then
        exactly.crash_point(exactly.COMPLETED)
        await self._record([], [packet_id])

    async def _record(self, add: list[tuple[int, str]], remove: list[int]) -> None:
        link = self.link
        if link.persistent:  # else the state ends with the connection
            update = link.host.durable.qos2_update
            await link.dispatcher.run(update, link.client_id, durable.OUTBOUND, add, remove)
