package io.lmq.mqtt;

import java.io.IOException;
import java.net.InetAddress;
import java.net.Socket;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import javax.net.SocketFactory;

/**
 * Plain TCP sockets that a scenario can close under the client: the broker then sees a connection lost without a
 * DISCONNECT, which is what publishes a will (3.1.1 §3.1.2.5, 5.0 §3.1.2.5).
 */
final class KillableSockets extends SocketFactory {
  private final List<Socket> sockets = new CopyOnWriteArrayList<>();

  void killAll() throws IOException {
    for (Socket s : sockets) {
      s.setSoLinger(true, 0); // a reset, as a crashed process would leave
      s.close();
    }
  }

  private Socket keep(Socket s) {
    sockets.add(s);
    return s;
  }

  @Override
  public Socket createSocket() {
    return keep(new Socket());
  }

  @Override
  public Socket createSocket(String host, int port) throws IOException {
    return keep(new Socket(host, port));
  }

  @Override
  public Socket createSocket(String host, int port, InetAddress local, int localPort) throws IOException {
    return keep(new Socket(host, port, local, localPort));
  }

  @Override
  public Socket createSocket(InetAddress host, int port) throws IOException {
    return keep(new Socket(host, port));
  }

  @Override
  public Socket createSocket(InetAddress host, int port, InetAddress local, int localPort) throws IOException {
    return keep(new Socket(host, port, local, localPort));
  }
}
