package io.lmq.mqtt;

import java.nio.charset.StandardCharsets;
import org.eclipse.paho.mqttv5.client.IMqttToken;
import org.eclipse.paho.mqttv5.client.MqttCallback;
import org.eclipse.paho.mqttv5.client.MqttClient;
import org.eclipse.paho.mqttv5.client.MqttConnectionOptions;
import org.eclipse.paho.mqttv5.client.MqttDisconnectResponse;
import org.eclipse.paho.mqttv5.client.persist.MemoryPersistence;
import org.eclipse.paho.mqttv5.common.MqttException;
import org.eclipse.paho.mqttv5.common.MqttMessage;
import org.eclipse.paho.mqttv5.common.packet.MqttProperties;

/** Eclipse Paho's MQTT 5.0 client (org.eclipse.paho.mqttv5.client). */
final class V5Client implements Client {
  static final long SESSION_EXPIRY_S = 300;
  private final MqttClient client;
  private final KillableSockets sockets = new KillableSockets();

  V5Client(String uri, String id, Scenarios.Inbox inbox) throws Exception {
    client = new MqttClient(uri, id, new MemoryPersistence());
    client.setCallback(
        new MqttCallback() {
          @Override
          public void disconnected(MqttDisconnectResponse response) {}

          @Override
          public void mqttErrorOccurred(MqttException exception) {}

          @Override
          public void messageArrived(String topic, MqttMessage m) {
            inbox.add(topic, m.getPayload(), m.getQos(), m.isRetained());
          }

          @Override
          public void deliveryComplete(IMqttToken token) {}

          @Override
          public void connectComplete(boolean reconnect, String serverURI) {}

          @Override
          public void authPacketArrived(int reasonCode, MqttProperties properties) {}
        });
  }

  @Override
  public boolean connect(boolean clean, String willTopic, String willPayload) throws Exception {
    MqttConnectionOptions options = new MqttConnectionOptions();
    options.setCleanStart(clean);
    options.setSessionExpiryInterval(clean ? 0L : SESSION_EXPIRY_S);
    options.setAutomaticReconnect(false);
    options.setSocketFactory(sockets);
    if (willTopic != null) {
      MqttMessage will = new MqttMessage(willPayload.getBytes(StandardCharsets.UTF_8));
      will.setQos(1);
      options.setWill(willTopic, will);
    }
    return client.connectWithResult(options).getSessionPresent();
  }

  @Override
  public int[] subscribe(String[] filters, int[] qos) throws Exception {
    return client.subscribe(filters, qos).getReasonCodes();
  }

  @Override
  public void publish(String topic, String payload, int qos, boolean retained) throws Exception {
    client.publish(topic, payload.getBytes(StandardCharsets.UTF_8), qos, retained);
  }

  @Override
  public void disconnect() throws Exception {
    client.disconnect();
  }

  @Override
  public void kill() throws Exception {
    sockets.killAll();
  }

  @Override
  public void close() {
    try {
      if (client.isConnected()) {
        client.disconnectForcibly(0, 1000, false);
      }
      client.close(true);
    } catch (Exception ignored) {
      // a killed client may already be closing itself
    }
  }
}
