package io.lmq.mqtt;

/** The few client calls the scenarios make, so they are written once for Paho's 3.1.1 and 5.0 clients. */
interface Client {
  /** Connects (clean session / clean start as asked; a 5.0 non-clean session gets an expiry) and returns the
   * CONNACK's session-present flag. */
  boolean connect(boolean clean, String willTopic, String willPayload) throws Exception;

  /** SUBACK's return codes (3.1.1 §3.9.3) or reason codes (5.0 §3.9.3), one per filter. */
  int[] subscribe(String[] filters, int[] qos) throws Exception;

  /** Returns when the publish is complete: written for QoS 0, PUBACK received for QoS 1. */
  void publish(String topic, String payload, int qos, boolean retained) throws Exception;

  void disconnect() throws Exception;

  /** Closes the TCP connection under the client, without DISCONNECT. */
  void kill() throws Exception;

  /** Frees the client's resources (after disconnect or kill). */
  void close();
}
