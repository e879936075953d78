"""tfos quick start: train a Keras model on a Spark DataFrame with 2 nodes, then predict an RDD."""
import os, sys, tempfile
from pyspark.sql import SparkSession
from tfos import TFCluster, authenticate_spark

def train_fun(args, ctx):                      # runs on every node, in its own TF process
    import tensorflow as tf, keras             # Keras 3: tfos makes model.fit work across nodes
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy", metrics=["accuracy"])
    ds = ctx.get_data_feed().as_dataset(64, (tf.TensorSpec((None,), tf.float32),) * 3)
    model.fit(ds.map(lambda x1, x2, y: (tf.stack([x1, x2], 1), y)), epochs=1, shuffle=False, verbose=0)  # a Dataset: fit does not shuffle it
    print(f"{ctx.job_name}:{ctx.task_index} trained")
    model.save(os.path.join(args["model_dir"], f"{ctx.job_name}-{ctx.task_index}.keras"))

def predict_fun(args, ctx):
    import numpy as np, keras
    model = keras.models.load_model(os.path.join(args["model_dir"], "chief-0.keras"))
    feed = ctx.get_data_feed(train_mode=False)
    while not feed.should_stop():
        rows = np.array(feed.next_batch(100), dtype=np.float32).reshape(-1, 3)
        if len(rows):                          # one result per row: (label, predicted class)
            feed.batch_results([(int(y), int(p > 0.5)) for y, p in zip(rows[:, 2], model.predict(rows[:, :2], verbose=0)[:, 0])])

if __name__ == "__main__":
    master = sys.argv[1] if len(sys.argv) > 1 else "local-cluster[2,1,1024]"
    authenticate_spark(master)     # spark.authenticate, its secret in a file only you can read (docs/deploy.md)
    spark = SparkSession.builder.master(master).appName("tfos-quickstart").getOrCreate()
    sc, args = spark.sparkContext, {"model_dir": tempfile.mkdtemp(prefix="tfos-quickstart-")}
    # label = 1 when x1 + x2 > 1, for points of the unit square
    df = spark.range(4000, numPartitions=4).selectExpr("rand(1) AS x1", "rand(2) AS x2").selectExpr(
        "CAST(x1 AS FLOAT) x1", "CAST(x2 AS FLOAT) x2", "CAST(x1 + x2 > 1 AS FLOAT) AS label")
    cluster = TFCluster.run(sc, train_fun, args, num_executors=2, num_ps=0,
                            input_mode=TFCluster.InputMode.SPARK, master_node="chief")
    cluster.train(df, num_epochs=5, end_of_feed=True)     # 5 passes over the DataFrame
    cluster.shutdown()
    test = sc.parallelize([(x / 50, y / 50, float(x + y > 50)) for x in range(50) for y in range(50)], 4)
    cluster = TFCluster.run(sc, predict_fun, args, 2, 0, input_mode=TFCluster.InputMode.SPARK, master_node="chief")
    results = cluster.inference(test).collect()
    cluster.shutdown()
    print(f"rows: {len(results)}, accuracy: {sum(y == p for y, p in results) / len(results):.3f}")
    spark.stop()
