package org.memquota;

/**
 * Thrown inside {@link MemQuota#withRetry} when memquota's retry machine rolls the
 * calling thread back: every task was blocked waiting for memory and this one, the
 * youngest, gives way. The attempt must free what it holds (in {@code finally}
 * blocks: {@code Unsafe.freeMemory}, a pool's pages) and let the error through;
 * {@code withRetry} then waits until an older task has freed memory or finished, and
 * runs the attempt again.
 *
 * <p>Thrown by {@code Unsafe.allocateMemory} (under direct buffers and Spark's
 * off-heap pages) and {@link MemQuota#scopeReserve} on a thread in a retry block.
 */
public class RetryOOM extends OutOfMemoryError {
    private static final long serialVersionUID = 1L;

    /** With memquota's message (the JVM's gate makes it through JNI). */
    public RetryOOM(String message) {
        super(message);
    }
}
