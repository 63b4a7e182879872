package io.cdclake.connect;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Map;
import org.apache.kafka.clients.producer.ProducerInterceptor;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;

/**
 * Stamps every record a Kafka Connect worker's producers send with the worker's shifted clock:
 * the wall clock plus the offset held in the file named by the environment variable
 * CDC_CONNECT_CLOCK_FILE ("+12.5s", "-86400.000s", "+0"), read again at most every 200 ms.
 *
 * <p>The tests and the demo's seeding produce changes "at" past hours this way (the pipeline
 * slices Kafka by record timestamps, which the worker's clock decides). Only the record
 * timestamps move: the worker's own clock, timeouts and Debezium's
 * source timestamps stay real. (Faking the JVM's clock with libfaketime made its timed waits
 * return at once, and its idle threads spun.) Every record gets the shifted time, also one the
 * connector stamped itself (Debezium stamps its records with its processing time).
 *
 * <p>Development and test tooling only (devtools/kafka_connect.py): not part of the pipeline.
 */
public final class ShiftedClockInterceptor implements ProducerInterceptor<byte[], byte[]> {
  private static final long REFRESH_NANOS = 200_000_000L;

  private Path file;
  private long offsetMillis;
  private long readAt;
  private boolean read;

  @Override
  public void configure(Map<String, ?> configs) {
    String name = System.getenv("CDC_CONNECT_CLOCK_FILE");
    file = name == null || name.isEmpty() ? null : Path.of(name);
  }

  @Override
  public ProducerRecord<byte[], byte[]> onSend(ProducerRecord<byte[], byte[]> record) {
    if (file == null) {
      return record;
    }
    long stamp = System.currentTimeMillis() + offset();
    return new ProducerRecord<>(
        record.topic(), record.partition(), stamp, record.key(), record.value(), record.headers());
  }

  private synchronized long offset() {
    long now = System.nanoTime();
    if (!read || now - readAt >= REFRESH_NANOS) {
      offsetMillis = parse(file);
      readAt = now;
      read = true;
    }
    return offsetMillis;
  }

  static long parse(Path file) {
    String text;
    try {
      text = Files.readString(file, StandardCharsets.UTF_8).trim();
    } catch (IOException e) {
      throw new IllegalStateException("cannot read the worker's clock file " + file, e);
    }
    if (text.endsWith("s")) {
      text = text.substring(0, text.length() - 1);
    }
    return Math.round(Double.parseDouble(text) * 1000.0);
  }

  @Override
  public void onAcknowledgement(RecordMetadata metadata, Exception exception) {}

  @Override
  public void close() {}
}
