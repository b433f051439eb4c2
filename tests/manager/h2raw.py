"""A gRPC unary call over a Unix socket in raw HTTP/2 frames (RFC 9113), with any
`:authority`: what grpc-go in kubelets 1.20-1.25 sends (the socket path) cannot be sent by a
tonic client, and grpcio will not send an empty one. Shares no code with the manager (HPACK
by the `hpack` package, python-hyper's).

    status, body = unary(path, "/v1beta1.DevicePlugin/GetDevicePluginOptions", b"", authority="/x.sock")
"""

import socket
import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


class Reset(Exception):
    """The server reset the stream (`code` 1 is PROTOCOL_ERROR) or the connection."""

    def __init__(self, what, code):
        super().__init__(f"{what} with error code {code}")
        self.code = code


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def unary(path, method, message, authority="localhost", timeout=10):
    """Call `method` with the serialized protobuf `message`; return (grpc-status, response
    message bytes). Raises Reset if the server resets the stream."""
    enc, dec = hpack.Encoder(), hpack.Decoder()
    headers = [
        (":method", "POST"), (":scheme", "http"), (":path", method), (":authority", authority),
        ("content-type", "application/grpc"), ("user-agent", "grpc-go/1.27.1"), ("te", "trailers"),
    ]
    body = b"\0" + struct.pack(">I", len(message)) + message
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(str(path))
    try:
        s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, enc.encode(headers))
                  + frame(DATA, END_STREAM, 1, body))
        buf, data, fields = b"", b"", {}
        while True:
            while len(buf) >= 9:
                n = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + n:
                    break
                kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9:9 + n], buf[9 + n:]
                if kind == SETTINGS and not flags & ACK:
                    s.sendall(frame(SETTINGS, ACK, 0))
                elif kind == HEADERS and stream == 1:
                    fields.update({k if isinstance(k, str) else k.decode(): v if isinstance(v, str) else v.decode()
                                   for k, v in dec.decode(payload)})
                    if flags & END_STREAM:
                        msg = data[5:5 + int.from_bytes(data[1:5], "big")] if len(data) >= 5 else b""
                        return fields.get("grpc-status"), msg
                elif kind == DATA and stream == 1:
                    data += payload
                elif kind == RST_STREAM and stream == 1:
                    raise Reset("RST_STREAM", int.from_bytes(payload[:4], "big"))
                elif kind == GOAWAY:
                    raise Reset("GOAWAY", int.from_bytes(payload[4:8], "big"))
            got = s.recv(65536)
            if not got:
                raise Reset("connection closed", -1)
            buf += got
    finally:
        s.close()
