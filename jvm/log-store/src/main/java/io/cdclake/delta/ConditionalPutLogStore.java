package io.cdclake.delta;

import io.delta.storage.S3SingleDriverLogStore;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InterruptedIOException;
import java.nio.charset.StandardCharsets;
import java.util.Iterator;
import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataOutputStream;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Options;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.s3a.AWSServiceIOException;
import org.apache.hadoop.fs.s3a.RemoteFileChangedException;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Delta's S3 log store with the put-if-absent that makes several writers of one table safe: a
 * commit file is created with an S3 conditional write ({@code If-None-Match: *}), so of two
 * writers committing the same version, from any number of Spark drivers, exactly one succeeds
 * and the other gets Delta's {@link java.nio.file.FileAlreadyExistsException} (Delta then checks
 * the winner's commit for conflicts and retries on the next version, as on HDFS).
 *
 * <p>Delta's own {@link S3SingleDriverLogStore} checks that the file is absent and then writes it,
 * serialized by a lock inside one JVM only: two drivers can both find the version free, and the
 * later write replaces the earlier commit on S3 without an error. Delta 4.4 has no conditional
 * write of its own; Hadoop 3.5's S3A makes one on request ({@code
 * fs.option.create.conditional.overwrite}, HADOOP-19256), which this class asks for. A store or
 * an S3A setting without conditional writes ({@code fs.s3a.create.conditional.enabled=false})
 * fails the write ("Conditional Writes Unavailable") instead of falling back to the unsafe one.
 *
 * <p>Set as {@code spark.delta.logStore.s3a.impl} (resources/spark.py). Overwrites (checkpoints,
 * {@code _last_checkpoint}) and reads and listings are Delta's own.
 */
public class ConditionalPutLogStore extends S3SingleDriverLogStore {
  private static final Logger LOG = LoggerFactory.getLogger(ConditionalPutLogStore.class);

  /** A conditional write S3 could not decide yet (409 ConditionalRequestConflict) is retried. */
  private static final int CONFLICT_ATTEMPTS = 5;

  private static final int SC_CONFLICT = 409;

  public ConditionalPutLogStore(Configuration hadoopConf) {
    super(hadoopConf);
  }

  @Override
  public void write(
      Path path, Iterator<String> actions, Boolean overwrite, Configuration hadoopConf)
      throws IOException {
    if (overwrite) {
      super.write(path, actions, true, hadoopConf);
      return;
    }
    FileSystem fs = path.getFileSystem(hadoopConf);
    Path resolved = fs.makeQualified(path);
    // The whole file is sent in one PUT when the stream closes; kept to send it again after a 409.
    ByteArrayOutputStream body = new ByteArrayOutputStream();
    while (actions.hasNext()) {
      body.write((actions.next() + "\n").getBytes(StandardCharsets.UTF_8));
    }
    for (int attempt = 1; ; attempt++) {
      try {
        putIfAbsent(fs, resolved, body);
        return;
      } catch (RemoteFileChangedException e) {
        // 412 Precondition Failed: the version exists. Ours, when S3A sent the PUT again after
        // its first answer was lost (the first one created it): then this commit is done.
        if (holds(fs, resolved, body)) {
          LOG.info("{} already holds this commit (a retried PUT whose first answer was lost)",
              resolved);
          return;
        }
        // Another writer created this version first.
        LOG.info("{} was committed by another writer first; Delta retries on the next version",
            resolved);
        throw (java.nio.file.FileAlreadyExistsException)
            new java.nio.file.FileAlreadyExistsException(resolved.toString()).initCause(e);
      } catch (AWSServiceIOException e) {
        if (e.statusCode() != SC_CONFLICT || attempt >= CONFLICT_ATTEMPTS) {
          throw e;
        }
        // S3 answers 409 while a concurrent conditional write of the same key is in flight:
        // nothing was written, and the next attempt gets the outcome (created, or 412).
        LOG.info("conditional write of {} conflicted with another in flight; attempt {} of {}",
            resolved, attempt + 1, CONFLICT_ATTEMPTS);
        try {
          Thread.sleep(100L * attempt);
        } catch (InterruptedException interrupted) {
          Thread.currentThread().interrupt();
          throw new InterruptedIOException("interrupted while retrying " + resolved);
        }
      }
    }
  }

  /** Whether the file at {@code path} holds exactly {@code body}: a commit's actions carry its
   * own commitInfo (timestamp, operation, metrics), so another writer's commit never does. */
  private static boolean holds(FileSystem fs, Path path, ByteArrayOutputStream body)
      throws IOException {
    byte[] expected = body.toByteArray();
    ByteArrayOutputStream found = new ByteArrayOutputStream(expected.length);
    try (java.io.InputStream in = fs.open(path)) {
      byte[] buffer = new byte[8192];
      for (int n; (n = in.read(buffer)) > 0; ) {
        found.write(buffer, 0, n);
        if (found.size() > expected.length) {
          return false;
        }
      }
    }
    return java.util.Arrays.equals(expected, found.toByteArray());
  }

  private static void putIfAbsent(FileSystem fs, Path path, ByteArrayOutputStream body)
      throws IOException {
    // createFile's builder is a raw type: build() is typed Object, the stream S3A returns.
    FSDataOutputStream out =
        (FSDataOutputStream)
            fs.createFile(path)
                .overwrite(false)
                .must(Options.CreateFileOptionKeys.FS_OPTION_CREATE_CONDITIONAL_OVERWRITE, true)
                .build();
    try {
      body.writeTo(out);
    } catch (IOException e) {
      out.abort(); // never a partial commit file: closing would upload what was written
      throw e;
    }
    out.close(); // the PUT, with If-None-Match: *
  }
}
