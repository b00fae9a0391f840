package org.memquota;

/**
 * Thrown inside a retry block when the calling thread's task cannot fit even with the
 * younger tasks rolled back, or asks for more than the whole pool: split the input
 * and process the pieces ({@link MemQuota#withSplitRetry} does;
 * {@link MemQuota#withRetry} lets it through).
 *
 * <p>Thrown by {@code Unsafe.allocateMemory} and {@link MemQuota#scopeReserve} on a
 * thread in a retry block.
 */
public class SplitAndRetryOOM extends OutOfMemoryError {
    private static final long serialVersionUID = 1L;

    /** With memquota's message (the JVM's gate makes it through JNI). */
    public SplitAndRetryOOM(String message) {
        super(message);
    }
}
